"""Allocation strategies, ported from RocketMQ's ``AllocateMessageQueueStrategy`` family.

Each strategy answers RocketMQ's question, "which of ``mq_all`` does ``current_cid`` consume?",
from sorted inputs, so every process computes the same answer. ``allocate_all`` turns that into a
whole assignment (queue -> client), which is what the central ``rebalance`` task writes.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from mqorder import keys
from mqorder.errors import ConfigError
from mqorder.model import MessageQueue
from mqorder.names import machine_room


class AllocateMessageQueueStrategy(Protocol):
    name: str

    def allocate(
        self, group: str, current_cid: str, mq_all: Sequence[MessageQueue], cid_all: Sequence[str]
    ) -> list[MessageQueue]: ...


def _check(current_cid: str, mq_all: Sequence[MessageQueue], cid_all: Sequence[str]) -> bool:
    if not current_cid:
        raise ValueError("current_cid is empty")
    return bool(mq_all) and current_cid in cid_all


class AllocateMessageQueueAveragely:
    """Contiguous blocks, the first ``len(mq) % len(cid)`` clients getting one more."""

    name = "averagely"

    def allocate(self, group, current_cid, mq_all, cid_all):
        if not _check(current_cid, mq_all, cid_all):
            return []
        index = list(cid_all).index(current_cid)
        n, c = len(mq_all), len(cid_all)
        mod = n % c
        if n <= c:
            average = 1
        elif mod > 0 and index < mod:
            average = n // c + 1
        else:
            average = n // c
        start = index * average if (mod > 0 and index < mod) else index * average + mod
        size = min(average, n - start)
        return [mq_all[(start + i) % n] for i in range(max(size, 0))]


class AllocateMessageQueueAveragelyByCircle:
    """Round robin: client ``i`` takes queues ``i, i + c, i + 2c, ...``."""

    name = "averagely_by_circle"

    def allocate(self, group, current_cid, mq_all, cid_all):
        if not _check(current_cid, mq_all, cid_all):
            return []
        index = list(cid_all).index(current_cid)
        return [mq_all[i] for i in range(index, len(mq_all), len(cid_all))]


class AllocateMessageQueueByConfig:
    """A fixed mapping of client id to queue keys (``topic:broker:qid``), from settings.

    Keys that name no existing queue are ignored (the topic may come later), but a string that is
    not a queue key at all is refused: it would silently leave a queue to nobody.
    """

    name = "by_config"

    def __init__(self, config: dict[str, list[str]]) -> None:
        if not isinstance(config, dict):
            raise ConfigError("MQORDER_ALLOCATE_CONFIG must be a JSON object of client id to queue keys")
        for cid, qs in config.items():
            for q in qs:
                try:
                    keys.parse_queue_key(q)
                except (ValueError, AttributeError):
                    raise ConfigError(
                        f"MQORDER_ALLOCATE_CONFIG[{cid!r}]: {q!r} is not a queue key (topic:broker:queue_id)"
                    ) from None
        self.config = {cid: set(qs) for cid, qs in config.items()}

    def allocate(self, group, current_cid, mq_all, cid_all):
        wanted = self.config.get(current_cid, set())
        return [mq for mq in mq_all if mq.key in wanted]


class AllocateMessageQueueByMachineRoom:
    """Queues of brokers named ``room@name`` in the consuming rooms, spread over all clients.

    A room is what comes before the first ``@`` of a broker name (``names.machine_room``), so a
    room name holding ``@`` could never match and is refused.
    """

    name = "by_machine_room"

    def __init__(self, rooms: Sequence[str]) -> None:
        for room in rooms:
            if not isinstance(room, str) or not keys.NAME_RE.fullmatch(room):
                raise ConfigError(
                    f"MQORDER_ALLOCATE_MACHINE_ROOMS: invalid machine room {room!r}; a room is the part "
                    "of a broker name before its first '@': letters, digits and % | _ . -"
                )
        self.rooms = set(rooms)

    def allocate(self, group, current_cid, mq_all, cid_all):
        if not _check(current_cid, mq_all, cid_all):
            return []
        index = list(cid_all).index(current_cid)
        pre = [mq for mq in mq_all if machine_room(mq.broker_name) in self.rooms]
        c = len(cid_all)
        mod, rem = divmod(len(pre), c)
        out = pre[mod * index : mod * index + mod]
        if rem > index:
            out.append(pre[index + mod * c])
        return out


def _md5_hash(key: str) -> int:
    d = hashlib.md5(key.encode("utf-8"), usedforsecurity=False).digest()
    return int.from_bytes(d[:8], "big")


#: Virtual nodes per client on the consistent-hash ring (RocketMQ's default virtualNodeCnt); also
#: the default of ``MQORDER_CONSISTENT_HASH_VIRTUAL_NODES``.
DEFAULT_VIRTUAL_NODES = 10


class AllocateMessageQueueConsistentHash:
    """A hash ring with virtual nodes: a client joining or leaving moves only its share of queues."""

    name = "consistent_hash"

    def __init__(self, virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ConfigError("consistent hash needs at least 1 virtual node per client")
        self.virtual_nodes = virtual_nodes

    def _ring(self, cid_all: Sequence[str]) -> tuple[list[int], list[str]]:
        points = sorted(
            (_md5_hash(f"{cid}-{i}"), cid) for cid in cid_all for i in range(self.virtual_nodes)
        )
        return [p for p, _ in points], [c for _, c in points]

    def allocate(self, group, current_cid, mq_all, cid_all):
        if not _check(current_cid, mq_all, cid_all):
            return []
        hashes, owners = self._ring(cid_all)
        out = []
        for mq in mq_all:
            i = bisect.bisect_left(hashes, _md5_hash(mq.key)) % len(hashes)
            if owners[i] == current_cid:
                out.append(mq)
        return out


class AllocateStrategy(StrEnum):
    """``MQORDER_ALLOCATE_STRATEGY``: RocketMQ's five allocation strategies, by their short names."""

    AVERAGELY = "averagely"
    AVERAGELY_BY_CIRCLE = "averagely_by_circle"
    BY_CONFIG = "by_config"
    BY_MACHINE_ROOM = "by_machine_room"
    CONSISTENT_HASH = "consistent_hash"


def strategy_from_settings(settings) -> AllocateMessageQueueStrategy:
    name = settings.allocate_strategy
    if name == AllocateStrategy.AVERAGELY:
        return AllocateMessageQueueAveragely()
    if name == AllocateStrategy.AVERAGELY_BY_CIRCLE:
        return AllocateMessageQueueAveragelyByCircle()
    if name == AllocateStrategy.BY_CONFIG:
        return AllocateMessageQueueByConfig(settings.allocate_config)
    if name == AllocateStrategy.BY_MACHINE_ROOM:
        return AllocateMessageQueueByMachineRoom(settings.allocate_machine_rooms)
    if name == AllocateStrategy.CONSISTENT_HASH:
        return AllocateMessageQueueConsistentHash(settings.consistent_hash_virtual_nodes)
    raise ConfigError(f"unknown allocation strategy {name!r}")


def allocate_all(
    strategy: AllocateMessageQueueStrategy,
    group: str,
    mq_all: Sequence[MessageQueue],
    cid_all: Sequence[str],
) -> dict[MessageQueue, str]:
    """Queue -> client for every client; a queue no strategy hands out is left unassigned."""
    mqs = sorted(mq_all)
    cids = sorted(set(cid_all))
    out: dict[MessageQueue, str] = {}
    for cid in cids:
        for mq in strategy.allocate(group, cid, mqs, cids):
            out.setdefault(mq, cid)
    return out
