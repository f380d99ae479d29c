"""Traffic: the paced producer of a scenario, its poison messages, and the wait for a drain.

The producer keeps its acknowledgements in this process's memory, never in a Redis that a
scenario may kill: an acknowledgement is the promise the checker holds the cluster to. With
``wait_replicas`` (the Sentinel scenarios) a send is acknowledged only once that many replicas
hold it; short of them it is an *unknown* send like one that timed out.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from chaos.listeners import GROUP, TOPIC
from mqorder import Producer
from mqorder.client.selector import Selector
from mqorder.errors import BrokerRefusedError, BrokerUnavailableError
from mqorder.model import MessageQueue
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog


@dataclass
class Ack:
    key: str
    seq: int
    queue: int
    offset: int
    t: float


@dataclass(frozen=True)
class Poison:
    """A poison message sent by the runner: its id, where it was stored, and when it was acked."""

    id: int
    queue: int
    offset: int
    t: float


#: Redis error codes a refused write names (``mqorder.store.failures``): how an unknown send is told apart.
_CODES = ("NOREPLICAS", "READONLY", "MASTERDOWN", "MISCONF", "OOM", "LOADING")


def why(exc: BaseException) -> str:
    """What an unknown send ran into: the error's class and, for a write Redis refused, its code
    (``BrokerRefusedError:NOREPLICAS``: an old primary with no replica refused it)."""
    name = type(exc).__name__
    if isinstance(exc, BrokerRefusedError | redis.ResponseError):
        code = next((c for c in _CODES if c in str(exc)), "")
        return f"{name}:{code}" if code else name
    return name


def _spread(pid: int) -> Selector:
    """The selector of poison message ``pid``: consecutive ones land on different queues."""

    def select(mqs: Sequence[MessageQueue], key: object, body: bytes) -> MessageQueue:
        return mqs[(pid * 5) % len(mqs)]

    return select


class ProducerThread(threading.Thread):
    """Sends ``{"k": key, "s": seq}`` at a steady pace over ``n_keys`` keys with ``send_orderly``.

    A send that raised is not acknowledged; it is recorded as *unknown* (it may or may not be
    stored) and the same (key, seq) is retried until acknowledged, so per-key sequences stay
    contiguous. Acks live in this process's memory only.
    """

    def __init__(self, url: str, rate: float, n_keys: int, seed: int = 7, wait_replicas: int | None = None,
                 topic: str = TOPIC, key_prefix: str = "k") -> None:
        super().__init__(name=f"chaos-producer-{topic}", daemon=True)
        self.url = url
        self.rate = rate
        #: ``send_orderly(..., wait_replicas=)`` of every send (None: the setting's default, 0).
        self.wait_replicas = wait_replicas
        self.topic = topic
        #: Keys of one topic never look like another's: a message run by another topic's listener
        #: is a stranger in that listener's records (``checker._strangers``).
        self.keys = [f"{key_prefix}{i:04d}" for i in range(n_keys)]
        self.rng = random.Random(seed)
        self.next_seq = dict.fromkeys(self.keys, 1)
        self.acks: list[Ack] = []
        self.unknown: list[tuple[str, int, float, str]] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the runner
            self.error = exc

    def _run(self) -> None:
        producer = Producer(self.url)
        period = 1.0 / self.rate
        t_next = time.monotonic()
        try:
            while not self.stop_event.is_set():
                key = self.rng.choice(self.keys)
                seq = self.next_seq[key]
                body = f'{{"k": "{key}", "s": {seq}}}'.encode()
                while not self.stop_event.is_set():
                    try:
                        res = producer.send_orderly(self.topic, body, sharding_key=key,
                                                     wait_replicas=self.wait_replicas)
                    except (BrokerUnavailableError, redis.RedisError) as exc:
                        self.unknown.append((key, seq, time.time(), why(exc)))
                        time.sleep(0.05)
                        continue
                    self.acks.append(Ack(key, seq, res.message_queue.queue_id, res.queue_offset, time.time()))
                    self.next_seq[key] = seq + 1
                    break
                t_next += period
                delay = t_next - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -1.0:  # fell behind (an outage): do not burst to catch up
                    t_next = time.monotonic()
        finally:
            producer.close()


#: The traffic of a topic other than the chaos one (``groups-kill``): this share of the scenario's
#: rate, over keys named with this prefix.
EXTRA_RATE_SHARE = 1 / 3
EXTRA_KEY_PREFIX = "c"


class Traffic:
    """Steady traffic over the scenario's topic (and its other groups' topics), poison messages on
    demand, and the drain.

    ``groups``: the consumer groups beyond the chaos one (``groups-kill``) and the queues of the
    topic each consumes. A topic other than the chaos one gets a producer of its own, at
    ``EXTRA_RATE_SHARE`` of ``rate``; the drain waits for every group's queues."""

    def __init__(self, url: str, brokers: BrokerRegistry, mqs: list[MessageQueue], *,
                 rate: float, n_keys: int, wait_replicas: int | None = None,
                 groups: dict[str, list[MessageQueue]] | None = None) -> None:
        self.url = url
        self.brokers = brokers
        self.mqs = mqs
        self.groups = dict(groups or {})
        self.producer = ProducerThread(url, rate, n_keys, wait_replicas=wait_replicas)
        #: One producer per other topic, by topic.
        self.others = {
            topic: ProducerThread(url, rate * EXTRA_RATE_SHARE, n_keys, seed=8, wait_replicas=wait_replicas,
                                  topic=topic, key_prefix=EXTRA_KEY_PREFIX)
            for topic in sorted({q.topic for qs in self.groups.values() for q in qs} - {TOPIC})
        }
        self.poison: list[Poison] = []
        self.started = False

    @property
    def producers(self) -> list[ProducerThread]:
        return [self.producer, *self.others.values()]

    def start(self) -> None:
        self.started = True
        for p in self.producers:
            p.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop sending; raise if a producer itself failed (its acks would be incomplete)."""
        if not self.started:
            return
        for p in self.producers:
            p.stop_event.set()
        for p in self.producers:
            p.join(timeout)
            if p.error is not None:
                raise RuntimeError(f"producer of {p.topic} failed: {p.error!r}")

    def _of(self, topic: str) -> ProducerThread:
        return self.producer if topic == TOPIC else self.others[topic]

    @property
    def acks(self) -> list[Ack]:
        return list(self.producer.acks)

    @property
    def unknown(self) -> list[tuple[str, int, float, str]]:
        return list(self.producer.unknown)

    def acks_of(self, topic: str) -> list[Ack]:
        """The acknowledged sends to ``topic`` (the chaos topic's are ``acks``)."""
        return list(self._of(topic).acks)

    def unknown_of(self, topic: str) -> list[tuple[str, int, float, str]]:
        return list(self._of(topic).unknown)

    def send_poison(self, count: int) -> list[Poison]:
        """Send ``count`` poison messages, each to a different queue, among the regular traffic."""
        p = Producer(self.url)
        sent = []
        try:
            start = len(self.poison)
            for i in range(count):
                pid = start + i
                res = p.send_orderly(TOPIC, f'{{"poison": true, "id": {pid}}}'.encode(), sharding_key=pid,
                                     selector=_spread(pid))
                sent.append(Poison(pid, res.message_queue.queue_id, res.queue_offset, time.time()))
        finally:
            self.poison += sent
            p.close()
        return sent

    def drain(self, timeout: float) -> bool:
        """Wait until every queue's committed offset reached its end (twice in a row), in every group."""
        mlog = MessageLog(self.brokers)
        deadline = time.monotonic() + timeout
        streak = 0
        parties = [(GROUP, mq) for mq in self.mqs] + [(g, mq) for g, qs in self.groups.items() for mq in qs]
        while time.monotonic() < deadline:
            try:
                lag = sum(mlog.lag(group, mq) for group, mq in parties)
            except redis.RedisError:
                lag = -1
            streak = streak + 1 if lag == 0 else 0
            if streak >= 2:
                return True
            time.sleep(0.5)
        return False
