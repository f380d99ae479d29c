"""Checks shared by the Sentinel tests (``test_sentinel_connect``, ``test_sentinel_e2e``): order of
what was handled across a failover, where sends acknowledged without a replica wait may be lost
and lost consumption progress comes back as redelivery."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from mqorder.testing.sentinel import SentinelDeployment

#: The topic and group of ``tests/sentinel_listeners.py`` (here, so a test module need not import
#: the listener module: importing it registers the listener in the pytest process too).
TOPIC, GROUP = "t-sentinel", "g-sentinel"


def stamped_body(key: str, seq: int, sent: float) -> bytes:
    """A message body naming its key, sequence number and when this send attempt began (``sent``):
    a body made after the promotion can only have been stored on the promoted replica, whereas a
    (key, seq) resent after the kill may also have been stored, and handled, before it."""
    return json.dumps({"k": key, "s": seq, "t": sent}).encode()


def ledger_entries(client: redis.Redis, group: str) -> list[dict[str, Any]]:
    """The records ``tests/sentinel_listeners.py`` wrote for ``group``, in the order they were written."""
    return [json.loads(raw) for raw in client.lrange(f"ledger:{group}", 0, -1)]


def eventually(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Whether ``pred()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def order_violations(handled: Iterable[Mapping[str, Any]]) -> list[str]:
    """What breaks order in ``handled`` (entries with ``key``, ``seq``, ``queue``, ``offset``, in
    the order they were handled).

    Per queue an offset is the last one plus one, or at most the last one (a redelivery from an
    earlier offset: progress lost in the failover, or a fenced run); never a skip ahead. Per key,
    between two such rewinds, the sequence number never goes back (it may repeat: a send whose
    acknowledgement was lost is sent again). A gap in a key's sequence is not a violation: the
    send was lost in the replication window, it was never there to be handled.
    """
    out: list[str] = []
    by_queue: dict[int, list[Mapping[str, Any]]] = {}
    for h in handled:
        by_queue.setdefault(int(h["queue"]), []).append(h)
    for q, hs in sorted(by_queue.items()):
        last_seq: dict[str, int] = {}
        prev: Mapping[str, Any] | None = None
        for cur in hs:
            if prev is not None:
                if cur["offset"] > prev["offset"] + 1:
                    out.append(f"queue {q}: offset {cur['offset']} handled right after {prev['offset']}")
                if cur["offset"] <= prev["offset"]:
                    last_seq = {}  # a rewind: every key starts over from there
            if cur["seq"] < last_seq.get(cur["key"], 0):
                out.append(f"queue {q}: key {cur['key']} seq {cur['seq']} after {last_seq[cur['key']]} "
                           f"(offset {cur['offset']}) without a rewind")
            last_seq[cur["key"]] = cur["seq"]
            prev = cur
    return out


def longest_pause(times: Iterable[float], since: float) -> float:
    """The longest gap between two consecutive handling times from ``since`` on."""
    ts = sorted(t for t in times if t >= since)
    return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)


class SwitchWatch:
    """Every ``+switch-master`` the Sentinels publish, with when it was seen (``time.time()``).

    A failover test may see more than the one it caused: on a loaded machine the promoted primary
    can miss its Sentinels' PINGs for ``down-after-milliseconds`` and be failed over in turn, and
    the writes it acknowledged meanwhile may be lost with it (replication is asynchronous). What a
    test may then claim is about the primary that stayed.
    """

    def __init__(self, sentinels: Iterable[redis.Redis]) -> None:
        self._subs = []
        for s in sentinels:
            ps = s.pubsub(ignore_subscribe_messages=True)
            ps.subscribe("+switch-master")
            self._subs.append(ps)
        self.switches: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switch-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for ps in self._subs:
                try:
                    msg = ps.get_message(timeout=0.02)
                except redis.RedisError:
                    continue
                if msg and msg["type"] == "message":
                    # "<master> <old ip> <old port> <new ip> <new port>", once per Sentinel
                    port = int(msg["data"].split()[4])
                    if not self.switches or self.switches[-1][1] != port:
                        self.switches.append((time.time(), port))

    def since(self, t: float) -> list[tuple[float, int]]:
        """The switches seen at or after ``t``."""
        return [sw for sw in self.switches if sw[0] >= t]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for ps in self._subs:
            ps.close()


def sentinel_events(dep: SentinelDeployment) -> str:
    """What the Sentinels logged of the failover (its '#' events: down, votes, promotion, switch)."""
    lines = []
    for log in sorted(dep.dir.glob("sentinel-*.log")):
        lines += [f"{log.name}: {line}" for line in log.read_text().splitlines() if " # " in line]
    return "\n".join(lines)


def settle_on_the_primary_that_stays(dep: SentinelDeployment, switches: SwitchWatch, settled: Callable[[], bool],
                                     restarted: Callable[[int], None], most: int = 3) -> int:
    """Run ``settled`` (a test's phase after a promotion: False when Sentinel failed over again
    meanwhile, see ``SwitchWatch``) until a phase ends on the primary that stayed. Before each new
    phase, wait until the newest primary is the only live one (``wait_sole_primary``: no demoted
    node still takes writes) and call ``restarted`` with its port. Returns the promotions seen: 1
    when only the failover the test caused happened, at most ``most``."""
    promotions = 1
    while not settled():
        promotions += 1
        assert promotions <= most, f"the primary kept changing: {switches.switches}"
        port = switches.switches[-1][1]
        dep.wait_sole_primary(port, timeout=30)
        restarted(port)
    return promotions
