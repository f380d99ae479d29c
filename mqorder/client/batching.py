"""The batching producer behind ``Producer.send_orderly_async``: Kafka's ``linger.ms`` on Redis.

Why: at a trickle, a ``send_orderly`` costs its producer ~200 µs of CPU and Redis ~250 µs, almost
all of it per *call* (a round trip, a script call, the wake-up check), not per message (issue
27). Many threads each sending one message at a time pay that once per message. Kafka's answer
is to make every send asynchronous and let one background thread send what accumulated
together; this module is that answer, with Kafka's names:

* ``send_orderly_async`` (``mqorder.client.producer``) checks and encodes the message *in the
  caller's thread* (a bad body, key, tag or topic name raises there, at once), appends a
  ``ProducerRecord`` to the ``RecordAccumulator`` and returns a ``concurrent.futures.Future``.
* One ``Sender`` thread per producer (per process) waits until the oldest pending record has
  waited ``linger_ms``, or ``batch_size`` records are pending, or someone flushes; takes them,
  routes them (an unknown or read-only topic fails its own records' futures), and writes them
  with one round trip per broker: one ``send.lua`` call per queue chunk (``append_each``). Each
  future is then resolved with its ``SendResult`` or failed with the producer's usual error.

Order. Records enter the accumulator in call order, under its lock; a key always maps to one
queue; a queue's records are chunked in that order and its chunks sent in that order, on one
connection; and one batch is in flight at a time (Kafka's ``max.in.flight.requests=1``), its
retries included. So each key's messages are stored in the order their calls were made.

Failures. Each chunk is one atomic script call: stored whole, or not at all. A chunk refused by
Redis (``OOM``...) or by the capacity guard fails only its records' futures, others in the same
round trip are resolved (``append_each`` reads each call's reply in its place). A broker that did
not answer fails its chunks with ``BrokerUnavailableError`` (stored or not: unknown), except the
chunks whose records all carry dedup keys: those are sent again, up to
``retry_times_when_send_failed`` times, as ``send_orderly_batch`` does, since a dedup key makes a
resend store nothing twice. A chunk is never resent after a later chunk of its queue was stored
(the resend would land behind it). The pauses between resends hold up the batches behind, as
a resend must go before them to keep their order. Done-callbacks run in the sender's thread:
keep them short. A callback may send (a key's next message once the last one is acked): its send
never waits for buffer room (see ``RecordAccumulator.append``). What a callback raises, even a
``SystemExit``, is logged and the sender goes on. A failed record leaves a gap in its key, as a
failed ``send_orderly`` whose caller goes on does; a caller that needs no gaps resolves each
future before sending the key's next message, or sends with dedup keys.

Memory. ``buffer_memory`` bounds the bytes (header + body) of records not yet resolved. A send
that finds it full blocks up to ``max_block_ms``, then raises ``BufferExhaustedError`` (Kafka's
``buffer.memory`` / ``max.block.ms``); a message bigger than the whole buffer is refused at once.
A done-callback's send is the exception: it never blocks (``RecordAccumulator.append``).
``linger_ms`` and ``max_block_ms`` are waits, so at most ``threading.TIMEOUT_MAX`` (in ms): a
thread's ``wait`` takes none longer.

Lifetime. ``flush()`` waits for every record appended before it; ``close()`` sends everything
pending and stops the thread; at interpreter exit every live sender of the process is closed
(``atexit``). Should the sender's thread ever stop on an error of its own, every send it held fails
with ``ProducerClosedError`` and later sends raise it. A forked child (Celery's prefork pool forks
its workers) inherits the parent's sender object but not its thread: the producer sees the pid
change and starts a sender of its own, with an empty accumulator; what the parent had pending is
the parent's to send, once.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import redis

from mqorder.client.dedup import first_send_result
from mqorder.errors import (
    BrokerUnavailableError,
    BufferExhaustedError,
    ConfigError,
    MessageTooLargeError,
    ProducerClosedError,
)
from mqorder.model import MessageQueue, SendResult, SendStatus
from mqorder.store.append import AppendReply, AppendRequest, QueueAppender
from mqorder.store.append_each import append_each
from mqorder.store.durable import SendWait
from mqorder.store.log import MessageLog

log = logging.getLogger(__name__)

#: Kafka 4's ``linger.ms`` default: a send waits at most this long for others to join it.
DEFAULT_LINGER_MS = 5
#: Records pending that send a batch before the linger ends (Kafka counts bytes per partition;
#: a count reads better here, where a queue chunk is a count).
DEFAULT_BATCH_SIZE = 1000
#: Kafka's ``buffer.memory``: 32 MiB of pending headers and bodies.
DEFAULT_BUFFER_MEMORY = 32 * 1024 * 1024
#: Kafka's ``max.block.ms``: how long a send waits for room in a full buffer.
DEFAULT_MAX_BLOCK_MS = 60_000
#: At most this many messages per queue chunk (one script call), as ``send_orderly_batch``.
CHUNK = 256
#: Pause before the n-th resend of a keyed chunk, as the producer's keyed retries.
RETRY_PAUSE = (0.05, 0.2, 0.5, 1.0)
#: How long interpreter exit waits for the pending sends of each producer.
EXIT_FLUSH_TIMEOUT_S = 30.0
#: The longest ``linger_ms`` / ``max_block_ms``: a thread cannot wait longer (``threading.TIMEOUT_MAX``,
#: about 292 years on Linux); an infinite or NaN wait would raise in the thread that waits.
MAX_WAIT_MS = threading.TIMEOUT_MAX * 1000


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """``Producer(linger_ms=, batch_size=, buffer_memory=, max_block_ms=)``, checked once."""

    linger_ms: float = DEFAULT_LINGER_MS
    batch_size: int = DEFAULT_BATCH_SIZE
    buffer_memory: int = DEFAULT_BUFFER_MEMORY
    max_block_ms: float = DEFAULT_MAX_BLOCK_MS

    @classmethod
    def of(cls, *, linger_ms: object = None, batch_size: object = None, buffer_memory: object = None,
           max_block_ms: object = None) -> BatchingConfig:
        """The given values over the defaults; ``ConfigError`` naming the argument if one is wrong."""
        d = cls()
        return cls(
            linger_ms=number_arg("linger_ms", linger_ms, d.linger_ms, minimum=0, maximum=MAX_WAIT_MS,
                                 hint="0 sends at once, 2-5 batches"),
            batch_size=int(number_arg("batch_size", batch_size, d.batch_size, minimum=1, integer=True,
                                      hint="records pending that end the linger early")),
            buffer_memory=int(number_arg("buffer_memory", buffer_memory, d.buffer_memory, minimum=1, integer=True,
                                         hint="bytes of pending messages, e.g. 32 * 1024 * 1024")),
            max_block_ms=number_arg("max_block_ms", max_block_ms, d.max_block_ms, minimum=0, maximum=MAX_WAIT_MS,
                                    hint="0 raises at once when the buffer is full"),
        )


def number_arg(name: str, value: object, default: float, *, minimum: float, hint: str, integer: bool = False,
               maximum: float = math.inf) -> float:
    """``value`` as a float, or ``default`` for ``None``; ``ConfigError`` unless ``minimum <= value <=
    maximum`` (so never NaN, nor infinite with a finite ``maximum``)."""
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not minimum <= value <= maximum:  # type: ignore[operator]
        kind = "a whole number" if integer else "a number"
        limit = "" if maximum == math.inf else f" and <= {maximum:,.0f}, the longest wait Python's threads allow"
        raise ConfigError(f"{name}={value!r}: must be {kind} >= {minimum:g}{limit} ({hint})")
    return float(value)  # type: ignore[arg-type]


class ProducerRecord:
    """One message between ``send_orderly_async`` and its future's resolution."""

    __slots__ = ("topic", "key_hash", "header", "body", "msg_id", "dedup_key", "future", "size")

    def __init__(self, topic: str, key_hash: int, header: bytes, body: bytes, msg_id: str,
                 dedup_key: str | None) -> None:
        self.topic = topic
        #: ``crc32`` of the sharding key: the queue is ``queues[key_hash % len(queues)]``, as
        #: ``send_orderly``'s default selector picks it.
        self.key_hash = key_hash
        self.header = header
        self.body = body
        self.msg_id = msg_id
        self.dedup_key = dedup_key
        self.future: Future[SendResult] = Future()
        self.size = len(header) + len(body)


class RecordAccumulator:
    """The records waiting for the sender, bounded by ``buffer_memory`` bytes (Kafka's class of
    the same name). Appenders never wake the sender per record: only the first record of an empty
    accumulator (the sender sleeps without a deadline then), a full batch, or a blocked appender."""

    def __init__(self, config: BatchingConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        #: The sender waits here for records to become ready.
        self._ready = threading.Condition(self._lock)
        #: Appenders blocked on a full buffer wait here for a batch to complete.
        self._room = threading.Condition(self._lock)
        self._records: deque[ProducerRecord] = deque()
        #: When the oldest pending record was appended (``time.monotonic``).
        self._first_at = 0.0
        #: Bytes of records appended and not yet resolved (pending or in flight).
        self._used = 0
        self._in_flight: list[ProducerRecord] = []
        #: Bytes of ``_in_flight``: freed as soon as its callbacks have run.
        self._in_flight_bytes = 0
        self._flushing = 0
        self._blocked = 0
        self._closed = False
        #: Why the sender's thread stopped, if it stopped on an error (``abort``): appends refused.
        self._dead: BaseException | None = None
        #: The thread that drains this accumulator (``Sender`` sets it), whose appends never wait.
        self.sender_thread: threading.Thread | None = None

    def append(self, record: ProducerRecord) -> None:
        """Queue ``record``; block while the buffer is full, up to ``max_block_ms``.

        Except in the sender's own thread (a future's done-callback that sends, e.g. a key's next
        message once the last one is acked): that thread cannot wait for room, as it alone frees
        room, once the callbacks of the batch in flight have run. Such a send is admitted at once
        if the buffer has room for it counting the batch in flight as freed already, which it is
        as soon as the callback returns: the buffer then holds at most ``buffer_memory`` bytes
        again, and at most the batch in flight more meanwhile. Without that room (the buffer full
        of sends not yet in flight) it raises ``BufferExhaustedError`` at once, saying so, rather
        than stall every send for ``max_block_ms`` and blame Redis.
        """
        with self._lock:
            if self._dead is not None:
                raise _stopped(self._dead, "send_orderly_async refused, nothing was sent")
            if self._closed:
                raise ProducerClosedError("this producer is closed: send_orderly_async refused; build a new Producer")
            if self._used + record.size > self.config.buffer_memory:
                if threading.current_thread() is self.sender_thread:
                    self._admit_from_sender(record.size)
                else:
                    self._wait_for_room(record.size)
            self._used += record.size
            records = self._records
            records.append(record)
            if len(records) == 1:
                self._first_at = time.monotonic()
                self._ready.notify()
            elif len(records) == self.config.batch_size:
                self._ready.notify()

    def _admit_from_sender(self, size: int) -> None:
        """``append`` in the sender's thread with the buffer full: see ``append``."""
        if self._used - self._in_flight_bytes + size <= self.config.buffer_memory:
            return
        raise BufferExhaustedError(
            f"send_orderly_async from a future's done-callback found the producer's buffer full "
            f"(buffer_memory={self.config.buffer_memory:,} bytes, {self._used - self._in_flight_bytes:,} held by "
            f"{len(self._records):,} sends not yet sent): callbacks run in the sender's thread, which cannot wait "
            "for room while it runs them. The message was not sent; send it from another thread (hand it to a "
            "queue or an executor), or raise buffer_memory"
        )

    def _wait_for_room(self, size: int) -> None:
        deadline = time.monotonic() + self.config.max_block_ms / 1000
        self._blocked += 1
        try:
            self._ready.notify()  # a full buffer sends now, whatever the linger
            while True:
                # Closed or stopped first: room freed by the last batch is no reason to queue a
                # record the sender may never drain.
                if self._dead is not None:
                    raise _stopped(self._dead, "send_orderly_async refused, nothing was sent")
                if self._closed:
                    raise ProducerClosedError("the producer was closed while this send waited for buffer room")
                if self._used + size <= self.config.buffer_memory:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferExhaustedError(
                        f"send_orderly_async waited max_block_ms={self.config.max_block_ms:g} for room in the "
                        f"producer's buffer (buffer_memory={self.config.buffer_memory:,} bytes, "
                        f"{self._used:,} held by {len(self._records) + len(self._in_flight):,} unresolved sends): "
                        "Redis takes the sends slower than they come, or does not answer. The message was not "
                        "sent; retry later, or raise buffer_memory / max_block_ms"
                    )
                self._room.wait(left)
        finally:
            self._blocked -= 1

    def drain(self) -> list[ProducerRecord] | None:
        """The next batch, once ready (the sender's thread); ``None`` when closed and empty."""
        config = self.config
        linger = config.linger_ms / 1000
        with self._lock:
            records = self._records
            while True:
                n = len(records)
                if n:
                    if n >= config.batch_size or self._flushing or self._blocked or self._closed:
                        break
                    left = self._first_at + linger - time.monotonic()
                    if left <= 0:
                        break
                    self._ready.wait(left)
                elif self._closed:
                    return None
                else:
                    self._ready.wait()
            if n <= config.batch_size:
                batch = list(records)
                records.clear()
            else:  # what is left is older than the linger already: it goes next, at once
                batch = [records.popleft() for _ in range(config.batch_size)]
            self._in_flight = batch
            self._in_flight_bytes = sum(r.size for r in batch)
            return batch

    def complete(self, batch: Sequence[ProducerRecord]) -> None:
        """``batch`` (the one in flight) is resolved: its bytes are free for blocked appenders."""
        with self._lock:
            self._used -= self._in_flight_bytes
            self._in_flight = []
            self._in_flight_bytes = 0
            self._room.notify_all()

    def abort(self, cause: BaseException) -> int:
        """The sender's thread stopped on ``cause`` (or ``close()`` found it stopped with records
        left): fail every record pending or in flight with ``ProducerClosedError``, free their
        bytes and refuse later appends. The number of records failed."""
        with self._lock:
            if self._dead is None:
                self._dead = cause
            pending, in_flight = list(self._records), self._in_flight
            self._used -= sum(r.size for r in pending) + self._in_flight_bytes
            self._records.clear()
            self._in_flight = []
            self._in_flight_bytes = 0
            self._ready.notify_all()
            self._room.notify_all()
            cause = self._dead
        # Outside the lock: a callback may send (and be refused).
        _fail(in_flight, _stopped(cause, "this send was in flight, so stored or not: unknown"))
        _fail(pending, _stopped(cause, "this send was not sent"))
        return len(pending) + len(in_flight)

    def drop_pending(self, cause: str) -> int:
        """Fail every record not sent yet with ``ProducerClosedError(cause)`` (``close(timeout)``
        gave up waiting); the batch in flight is the sender's to resolve. The number failed."""
        with self._lock:
            pending = list(self._records)
            self._records.clear()
            self._used -= sum(r.size for r in pending)
            self._ready.notify_all()
            self._room.notify_all()
        _fail(pending, ProducerClosedError(cause))  # outside the lock: a callback may send (refused)
        return len(pending)

    def holds_any(self) -> bool:
        """Whether a record is pending or in flight (read without the lock: a hint, for a caller
        that only orders its own earlier sends)."""
        return bool(self._records or self._in_flight)

    def unresolved(self) -> list[Future[SendResult]]:
        """The futures of every record pending or in flight now."""
        with self._lock:
            return [r.future for r in self._records] + [r.future for r in self._in_flight]

    def flush(self, timeout: float | None) -> None:
        """Wait for every record appended before this call (no linger meanwhile)."""
        with self._lock:
            futures = [r.future for r in self._records] + [r.future for r in self._in_flight]
            self._flushing += 1
            self._ready.notify()
        try:
            _, not_done = wait_futures(futures, timeout)
        finally:
            with self._lock:
                self._flushing -= 1
        if not_done:
            raise TimeoutError(f"flush: {len(not_done):,} of {len(futures):,} sends still unresolved after "
                               f"{timeout:g} s; they stay queued (close() sends them, or fails them)")

    def close(self) -> None:
        """No more appends; the sender sends what is pending, then stops."""
        with self._lock:
            self._closed = True
            self._ready.notify_all()
            self._room.notify_all()


@dataclass(slots=True)
class _Chunk:
    """One queue request (one script call) and the records it carries, in call order."""

    request: AppendRequest
    records: list[ProducerRecord]
    keyed: bool


#: Every running sender of this process, closed at interpreter exit.
_LIVE: weakref.WeakSet[Sender] = weakref.WeakSet()


class Sender:
    """The background thread that sends the accumulator's batches (Kafka's ``Sender``)."""

    def __init__(
        self,
        config: BatchingConfig,
        *,
        route: Callable[[str], Sequence[MessageQueue]],
        appender: QueueAppender,
        log_reader: MessageLog,
        dedup_window_ms: int,
        attempts: int,
        wait: SendWait | None,
    ) -> None:
        self.config = config
        self.accumulator = RecordAccumulator(config)
        #: The process that started this sender: another pid means a forked child's copy.
        self.pid = os.getpid()
        self._route = route
        self._appender = appender
        self._log = log_reader
        self._window_ms = dedup_window_ms
        self._attempts = max(1, attempts)
        self._wait = wait
        #: What ``close`` left to run when the thread ends (it timed out while a batch was in
        #: flight), and whether it has ended; under ``_end_lock``, so it runs exactly once.
        self._end_lock = threading.Lock()
        self._after: Callable[[], None] | None = None
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="mqorder-sender", daemon=True)
        self.accumulator.sender_thread = self._thread
        self._thread.start()
        _LIVE.add(self)

    # -- the callers' side ---------------------------------------------------------------------------

    def submit(self, record: ProducerRecord) -> Future[SendResult]:
        if record.size > self.config.buffer_memory:
            raise MessageTooLargeError(
                f"the message takes {record.size:,} bytes (header + body), more than the whole buffer "
                f"(buffer_memory={self.config.buffer_memory:,}); raise buffer_memory or send it with send_orderly"
            )
        self.accumulator.append(record)
        return record.future

    def flush(self, timeout: float | None = None) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() from a future's callback would wait for the thread that runs the "
                               "callback: flush from another thread, or let the callback only record the result")
        self.accumulator.flush(timeout)

    def close(self, timeout: float | None = None, then: Callable[[], None] | None = None) -> None:
        """Send everything pending, then stop the thread, then run ``then`` (give back the
        connections). What the thread left unresolved when it ended (it stopped on an error)
        fails. With ``timeout`` (seconds), what is still unsent then fails
        (``ProducerClosedError``, nothing of it stored) and the batch in flight is left to the
        thread, which resolves it and runs ``then`` as it ends (Kafka's ``close(timeout)``; the
        connections are not pulled from under a write whose outcome would become unknown)."""
        self.accumulator.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                dropped = self.accumulator.drop_pending(
                    f"Producer.close(timeout={timeout:g}) gave up before this send was sent (nothing of it "
                    "was stored); send it again with a new Producer")
                log.warning("mqorder sender: close() timed out after %g s: %d unsent sends failed, the batch "
                            "in flight is left to the sender's thread", timeout, dropped)
            elif self.accumulator.unresolved():  # it stopped on an error
                self.accumulator.abort(RuntimeError("it ended with sends unresolved"))
        _LIVE.discard(self)
        if then is not None:
            with self._end_lock:
                ended = self._ended
                if not ended:
                    self._after = then
            if ended:
                then()

    def _end(self) -> None:
        """The thread's last step: what ``close`` left it to run."""
        with self._end_lock:
            self._ended = True
            after, self._after = self._after, None
        if after is not None:
            try:
                after()
            except Exception:  # giving back connections: nothing waits on it, the thread ends
                log.warning("mqorder sender: giving back the producer's connections failed", exc_info=True)

    def in_sender_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the sender's thread -------------------------------------------------------------------------

    def _run(self) -> None:
        accumulator = self.accumulator
        try:
            while (batch := accumulator.drain()) is not None:
                try:
                    self.send(batch)
                except BaseException as exc:  # whatever it is, the thread goes on
                    # A bug (or an exception raised into this thread) must fail its own batch, not
                    # kill the thread every later send waits on. Done-callbacks cannot get here.
                    log.exception("mqorder sender: a batch failed unexpectedly")
                    _fail(batch, exc)
                finally:
                    accumulator.complete(batch)
        except BaseException as exc:  # the thread ends: nothing may wait on it
            log.exception("mqorder sender: the sender's thread stopped on an unexpected error")
            failed = accumulator.abort(exc)
            log.error("mqorder sender: %d unresolved sends failed; send_orderly_async now refuses", failed)
        finally:
            self._end()

    def send(self, batch: list[ProducerRecord]) -> None:
        """Route, chunk and write one batch; resolve or fail each record's future."""
        by_queue: dict[MessageQueue, list[ProducerRecord]] = {}
        by_topic: dict[str, list[ProducerRecord]] = {}
        for r in batch:
            if r.future.set_running_or_notify_cancel():  # a cancelled send is not sent
                by_topic.setdefault(r.topic, []).append(r)
        for topic, recs in by_topic.items():
            try:
                queues = self._route(topic)
            except Exception as exc:  # noqa: BLE001 - unknown, read-only, unreachable: those records' error
                _fail(recs, exc)
                continue
            n = len(queues)
            for r in recs:
                by_queue.setdefault(queues[r.key_hash % n], []).append(r)
        by_broker: dict[str, list[_Chunk]] = {}
        for mq, recs in by_queue.items():
            by_broker.setdefault(mq.broker_name, []).extend(self._chunks(mq, recs))
        for broker_name, chunks in by_broker.items():
            self._write(broker_name, chunks)

    def _chunks(self, mq: MessageQueue, recs: list[ProducerRecord]) -> Iterable[_Chunk]:
        """``recs`` (one queue's, in call order) as script calls of at most ``CHUNK`` records.
        Records with and without a dedup key share a call (the empty id is not remembered by the
        dedup window); a chunk is ``keyed`` (resendable) only if every record has a key."""
        for start in range(0, len(recs), CHUNK):
            part = recs[start:start + CHUNK]
            n_keyed = sum(r.dedup_key is not None for r in part)
            entries = [(r.header, r.body) for r in part]
            ids = [r.dedup_key or "" for r in part] if n_keyed else None
            yield _Chunk(AppendRequest(mq, entries, ids, self._window_ms if n_keyed else None), part,
                         n_keyed == len(part))

    def _write(self, broker_name: str, chunks: list[_Chunk]) -> None:
        """One broker's chunks in one round trip; failed keyed chunks sent again (see the module)."""
        todo = chunks
        for attempt in range(self._attempts):
            outcomes = append_each(self._appender, broker_name, [c.request for c in todo], wait=self._wait)
            failed: list[tuple[_Chunk, Exception]] = []
            for chunk, outcome in zip(todo, outcomes, strict=True):
                if isinstance(outcome, AppendReply):
                    self._resolve(chunk, outcome)
                else:
                    failed.append((chunk, outcome))
            if not failed:
                return
            retry = self._resendable(todo, outcomes) if attempt + 1 < self._attempts else set()
            for chunk, exc in failed:
                if id(chunk) not in retry:
                    _fail(chunk.records, exc)
            todo = [c for c in todo if id(c) in retry]
            if not todo:
                return
            time.sleep(RETRY_PAUSE[min(attempt, len(RETRY_PAUSE) - 1)])

    @staticmethod
    def _resendable(chunks: list[_Chunk], outcomes: list[AppendReply | Exception]) -> set[int]:
        """The failed chunks a resend may fix without storing twice or out of order: keyed ones
        that failed as the broker's (``BrokerUnavailableError`` and its kin), with no later chunk
        of their queue stored."""
        out: set[int] = set()
        stored_later: set[MessageQueue] = set()
        for chunk, outcome in zip(reversed(chunks), reversed(outcomes), strict=True):
            mq = chunk.request.mq
            if isinstance(outcome, AppendReply):
                stored_later.add(mq)
            elif chunk.keyed and isinstance(outcome, BrokerUnavailableError) and mq not in stored_later:
                out.add(id(chunk))
        return out

    def _resolve(self, chunk: _Chunk, reply: AppendReply) -> None:
        mq = chunk.request.mq
        store_ms = reply.store_ms
        if reply.stored == len(chunk.records):
            for r, off in zip(chunk.records, reply.offsets, strict=True):
                _settle(r.future, SendResult(SendStatus.SEND_OK, r.msg_id, mq, off, store_ms))
            return
        # Dedup keys seen before: a duplicate's result is its first send's (send_orderly_batch's rule).
        by_offset: dict[int, SendResult] = {}
        for r, off in zip(chunk.records, reply.offsets, strict=True):
            res = by_offset.get(off)
            if res is None:
                if off < reply.first_offset:
                    res = self._first_result(mq, off)
                else:
                    res = SendResult(SendStatus.SEND_OK, r.msg_id, mq, off, store_ms)
                by_offset[off] = res
            _settle(r.future, res)

    def _first_result(self, mq: MessageQueue, offset: int) -> SendResult:
        try:
            return first_send_result(self._log, mq, offset)
        except redis.RedisError:  # stored at ``offset`` all the same; its first id is not known now
            return SendResult(SendStatus.SEND_OK, "", mq, offset, 0)


def _fail(records: Iterable[ProducerRecord], exc: BaseException) -> None:
    for r in records:
        if not r.future.done():
            _settle(r.future, error=exc)


def _settle(future: Future[SendResult], result: SendResult | None = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` with ``result``, or fail it with ``error``. Its done-callbacks run here,
    in the sender's thread: ``Future`` logs what they raise as an ``Exception`` but lets anything
    else (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``...) out, which would leave the
    batch's other futures unresolved and could end the thread. The future is resolved by then: log
    it and go on (its later callbacks are skipped, as ``Future`` skips them)."""
    try:
        if error is None:
            future.set_result(result)  # type: ignore[arg-type]
        else:
            future.set_exception(error)
    except InvalidStateError:  # resolved already: a bug of ours, not a callback's
        raise
    except BaseException:  # a callback's, see above
        if not future.done():
            raise
        log.exception("mqorder sender: a future's done-callback raised; the sender goes on")


def _stopped(cause: BaseException, outcome: str) -> ProducerClosedError:
    """The error of a send once the sender's thread stopped on ``cause`` (``RecordAccumulator.abort``)."""
    what = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return ProducerClosedError(
        f"the producer's sender thread stopped on an unexpected error ({what}): {outcome}. "
        "Close this Producer and build a new one (the error's traceback is logged by mqorder.client.batching)"
    )


@atexit.register
def _close_at_exit() -> None:
    """Send what every producer of this process still holds before the interpreter exits."""
    for sender in list(_LIVE):
        if sender.pid != os.getpid():
            continue  # a forked child's copy of its parent's sender: not ours to send
        futures = sender.accumulator.unresolved()
        sender.close(EXIT_FLUSH_TIMEOUT_S)
        if sender.alive:
            log.warning("mqorder: %d sends were still unresolved %.0f s into interpreter exit", len(futures),
                        EXIT_FLUSH_TIMEOUT_S)
        _say_failed_at_exit(futures)


def _say_failed_at_exit(futures: list[Future[SendResult]]) -> None:
    """Sends that failed while the exit sent them: nobody reads their futures any more, and they
    went without a word (a walk-through stopped Redis and lost 20 sends with exit status 0)."""
    failed = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
    if failed:
        log.error("mqorder: %d of the %d sends that send_orderly_async still held at interpreter exit failed "
                  "(each error says whether it was not stored or its outcome is unknown); the first: %s: %s. "
                  "Call flush() or close() before exiting to see each send's outcome", len(failed), len(futures),
                  type(failed[0]).__name__, failed[0])
