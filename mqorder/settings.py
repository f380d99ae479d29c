"""Settings, read from ``MQORDER_*`` environment variables, with RocketMQ's defaults.

Every value is validated once at start; a bad one raises ``ConfigError`` naming the variable, the
value given and what is allowed, instead of failing deep inside a worker an hour later.
"""

from __future__ import annotations

import ipaddress
import json
import re
from functools import lru_cache
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mqorder.errors import ConfigError
from mqorder.retention.policy import RetentionPolicy, RetentionRule, check_policy
from mqorder.store.brokers import celery_transport, check_celery_broker_url, check_redis_url, redact_url

DEDUP_DERIVE = ("none", "msg_id", "content")
_DELAY_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_delay_levels(text: str) -> list[int]:
    """RocketMQ's ``messageDelayLevel`` ("1s 5s 10s 30s 1m ... 2h") as ms per level; ``ms`` is
    accepted too ("200ms"), for fast retries in tests and latency-sensitive retry topics."""
    out = []
    for item in text.split():
        num, unit = (item[:-2], 1) if item.endswith("ms") else (item[:-1], _DELAY_UNITS.get(item[-1:]))
        if unit is None or not num.isdigit() or int(num) <= 0:
            raise ValueError(f"delay level {item!r} is not a positive number followed by ms, s, m, h or d "
                             "(e.g. '1s 5s 1m')")
        out.append(int(num) * unit)
    if not out:
        raise ValueError("needs at least one level, e.g. '1s 5s 10s 30s 1m'")
    return out


ALLOCATE_STRATEGIES = ("averagely", "averagely_by_circle", "by_config", "by_machine_room", "consistent_hash")
#: A DNS host name (RFC 1123 labels), for ``metrics_addr`` when it is not an IP address.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MQORDER_", extra="ignore", validate_default=True)

    # -- where things are ------------------------------------------------------------------------
    #: The default broker (``broker-a``): ``rediss://`` for TLS, ``redis://:password@host`` or
    #: ``redis://user:password@host`` for AUTH, ``unix:///path`` for a socket.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Celery's own broker; defaults to ``redis_url``. Redis or RabbitMQ (``amqp://``): it carries
    #: only mqorder's tasks, the store stays in Redis (docs/OPERATING.md, "Choosing Celery's broker").
    celery_broker_url: str | None = None
    #: More named brokers, as JSON: ``{"broker-b": "redis://host:6380/0"}``.
    brokers: dict[str, str] = Field(default_factory=dict)
    #: Comma-separated import paths of modules holding ``@orderly_listener`` functions.
    listeners: str = ""

    # -- rebalance and locks (RocketMQ defaults) ------------------------------------------------
    #: How a rebalance shares a topic's queues among a group's live clients: ``averagely``,
    #: ``averagely_by_circle``, ``by_config``, ``by_machine_room`` or ``consistent_hash`` (RocketMQ's five).
    allocate_strategy: str = "averagely"
    #: ByConfig: JSON ``{"client id": ["topic:broker:qid", ...]}``.
    allocate_config: dict[str, list[str]] = Field(default_factory=dict)
    #: ByMachineRoom: JSON list of consuming machine rooms; a broker named ``room@name`` is in ``room``.
    allocate_machine_rooms: list[str] = Field(default_factory=list)
    #: ConsistentHash: virtual nodes per client on the hash ring.
    consistent_hash_virtual_nodes: int = Field(10, ge=1, le=1000)
    #: Seconds a queue lock (lease) lives without renewal (RocketMQ's broker lockMaxLiveTime).
    lock_max_live_time: float = Field(60.0, gt=0, le=3600)  # broker lockMaxLiveTime
    #: Seconds between two renewals of a client's locks, ``lock_all`` (REBALANCE_LOCK_INTERVAL).
    lock_interval: float = Field(20.0, gt=0, le=3600)  # REBALANCE_LOCK_INTERVAL
    #: Seconds a client trusts its own lock without asking Redis again, capped at half the
    #: heartbeat timeout (the client's REBALANCE_LOCK_MAX_LIVE_TIME).
    client_lock_expire: float = Field(30.0, gt=0, le=3600)  # REBALANCE_LOCK_MAX_LIVE_TIME
    #: Seconds between beat's rebalances (workers also rebalance at once on a join or a leave).
    rebalance_interval: float = Field(20.0, gt=0, le=3600)
    #: Seconds between two heartbeats of a client (liveness, for fast failover).
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    #: Seconds without a heartbeat after which a client counts as gone and its queues move at once.
    heartbeat_timeout: float = Field(3.0, gt=0, le=600)
    #: Seconds between two sweeps for queues with a backlog and no live ConsumeRequest (lost tasks).
    sweep_interval: float = Field(2.0, gt=0, le=600)
    #: How long a dispatched but not yet started ConsumeRequest may wait before the sweep replaces it.
    pending_ttl: float = Field(10.0, gt=0, le=3600)
    #: How long a running ConsumeRequest's claim lives without a fenced call renewing it.
    run_lease: float = Field(60.0, gt=0, le=3600)

    # -- consumption (RocketMQ defaults) --------------------------------------------------------
    #: Messages read per pull (one Redis call), RocketMQ's pullBatchSize.
    pull_batch_size: int = Field(32, ge=1, le=1024)
    #: Messages per listener call (RocketMQ's consumeMessageBatchMaxSize).
    consume_message_batch_max_size: int = Field(1, ge=1, le=1024)
    #: Flow control: most messages held in a queue's ProcessQueue at once (pullThresholdForQueue).
    pull_threshold_for_queue: int = Field(1000, ge=1)
    #: How long a queue waits before a suspended batch is retried, in ms (suspendCurrentQueueTimeMillis).
    suspend_current_queue_time_millis: int = Field(1000, ge=10, le=30000)
    #: Seconds a ConsumeRequest may run before it yields its slot (MAX_TIME_CONSUME_CONTINUOUSLY).
    max_time_consume_continuously: float = Field(60.0, gt=0, le=3600)
    #: Retries of a failing message before it goes to ``%DLQ%<group>`` (``-1``: never).
    max_reconsume_times: int = Field(16, ge=-1)
    #: How long a drained ConsumeRequest waits for more messages before ending its run, while its
    #: worker has idle pool slots (threads and prefork pools; never solo). It gives the slot back
    #: within about 10 ms once another request waits for one, or the queue is reassigned.
    consume_linger_ms: int = Field(1000, ge=0, le=10_000)
    #: While it lingers, a drained request also watches every other idle queue of its subscription
    #: that its client owns (one blocking read over all of them) and runs whichever gets a message
    #: first, claimed through begin.lua: with fewer pool slots than queues, sends to idle queues
    #: then skip the wake-up and the new Celery task. Off: it watches its own queue only.
    consume_linger_idle_queues: bool = True
    #: Key-ordered listeners (``@orderly_listener(ordering="key")``): at most this many keys of one
    #: queue are handled at once (one call per key at a time, in offset order per key).
    key_concurrency: int = Field(16, ge=1, le=1024)
    #: Key-ordered listeners: stop pulling a queue while its pulled span (highest pulled offset
    #: minus the lowest unfinished one) is this wide (RocketMQ's consumeConcurrentlyMaxSpan).
    consume_concurrently_max_span: int = Field(2000, ge=1, le=100_000)
    #: Concurrent listeners (``@concurrent_listener``): at most this many calls of one queue at
    #: once (RocketMQ's consumeThreadMax, per queue here: one run per queue holds its calls).
    consume_concurrency: int = Field(16, ge=1, le=1024)
    #: Queues of a group's retry topic ``%RETRY%<group>`` (RocketMQ: retryQueueNums, 1), fixed
    #: when the topic is first created.
    retry_queue_nums: int = Field(1, ge=1, le=64)
    #: Record every handled message in the consumption ledger (``mqorder:ledger:<group>``), for
    #: audits; a listener may switch it on for itself with ``@orderly_listener(ledger=True)``.
    ledger: bool = False
    #: About how many records each ledger stream keeps (older ones are trimmed).
    ledger_max_len: int = Field(1_000_000, ge=1000, le=1_000_000_000)

    # -- retention and capacity (mqorder.retention, mqorder.store.capacity) ----------------------
    #: Default retention of every topic that did not choose its own (RocketMQ's fileReservedTime,
    #: 72 h): ``time`` trims what is older, consumed or not; ``consumed`` only what every group
    #: holding the topic has consumed (see ``mqorder.retention.policy``).
    retention_policy: str = "time"
    #: Default retention in ms of topics that set none (72 h); ledger records older than it are trimmed too.
    retention_ms: int = Field(72 * 3600 * 1000, ge=1000, le=366 * 24 * 3600 * 1000)
    #: ``consumed`` keeps at least this long of consumed messages, for replay.
    retention_min_ms: int = Field(3600 * 1000, ge=0, le=366 * 24 * 3600 * 1000)
    #: Most messages kept per queue (0: no cap).
    retention_max_messages: int = Field(0, ge=0)
    #: How often a worker's housekeeping runs a trim pass (one worker per interval does it).
    retention_interval: float = Field(5.0, gt=0, le=3600)
    #: Entries one trim script call removes at most: bounds how long Redis is busy (a few ms).
    retention_trim_chunk: int = Field(500, ge=1, le=100_000)
    #: Start workers and producers on a Redis whose ``maxmemory-policy`` may evict keys (an evicted
    #: stream or lock hash is silent data loss): only for throwaway setups.
    allow_eviction: bool = False
    #: Refuse sends with ``BrokerFullError`` once Redis's used memory passes this share of its
    #: ``maxmemory`` (RocketMQ's diskMaxUsedSpaceRatio, 75 %); consumption and trimming go on.
    max_memory_ratio: float = Field(0.75, gt=0, le=1.0)

    # -- metrics ---------------------------------------------------------------------------------
    #: TCP port of this worker's Prometheus endpoint (``/metrics``, ``mqorder.metrics.worker``);
    #: unset or empty: no endpoint, and no metrics work at all on the consume path.
    metrics_port: int | None = None
    #: Address that endpoint listens on (``0.0.0.0``: every interface, as in a container).
    metrics_addr: str = "0.0.0.0"

    # -- producing -------------------------------------------------------------------------------
    #: Largest body a producer accepts, in bytes (4 MiB); larger ones are refused with a clear error.
    max_message_size: int = Field(4 * 1024 * 1024, ge=1, le=512 * 1024 * 1024)
    #: Seconds a producer waits for one send (sendMsgTimeout).
    send_msg_timeout: float = Field(3.0, gt=0, le=600)
    #: Extra attempts of a failed send, on another broker where there is one (retryTimesWhenSendFailed).
    retry_times_when_send_failed: int = Field(2, ge=0, le=16)
    #: How long a producer dedup key is remembered per queue (SQS FIFO's 5 minutes): a resend of
    #: the same key within it returns the first send's result and stores nothing.
    dedup_window: float = Field(300.0, gt=0, le=86_400)
    #: The dedup key of a send that names none: ``none`` (only ``dedup_key=`` deduplicates),
    #: ``msg_id`` (every send is keyed by its own id: the producer's retries never duplicate) or
    #: ``content`` (the body's SHA-256, SQS's content-based deduplication).
    dedup_derive: str = "none"

    # -- delay messages (RocketMQ's messageDelayLevel) -----------------------------------------
    #: The delay of each ``delay_time_level`` (1 = the first), RocketMQ's broker default.
    message_delay_level: str = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
    #: How often each worker's client moves due delayed messages into their queues (a client duty).
    delay_move_interval: float = Field(1.0, gt=0, le=3600)

    # -- transactional messages (RocketMQ's broker defaults) -----------------------------------
    #: A half message is first checked back this long after phase one (transactionTimeout).
    transaction_timeout: float = Field(6.0, gt=0, le=86_400)
    #: Checked back at most this many times, then rolled back with that reason (transactionCheckMax).
    transaction_check_max: int = Field(15, ge=1, le=1000)
    #: How often the check-back beat task runs (transactionCheckInterval).
    transaction_check_interval: float = Field(60.0, gt=0, le=86_400)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return check_redis_url(v, "MQORDER_REDIS_URL")

    @field_validator("celery_broker_url")
    @classmethod
    def _celery_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        return check_celery_broker_url(v, "MQORDER_CELERY_BROKER_URL")

    @field_validator("brokers")
    @classmethod
    def _brokers(cls, v: dict[str, str]) -> dict[str, str]:
        for name, url in v.items():
            check_redis_url(url, f"MQORDER_BROKERS[{name!r}]")
        return v

    @field_validator("allocate_strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        v = v.strip().lower().replace("-", "_")
        if v not in ALLOCATE_STRATEGIES:
            raise ValueError(f"unknown strategy {v!r}; choose one of {', '.join(ALLOCATE_STRATEGIES)}")
        return v

    @field_validator("retention_policy")
    @classmethod
    def _retention_policy(cls, v: str) -> str:
        try:
            return check_policy(v).value
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    @field_validator("dedup_derive")
    @classmethod
    def _dedup_derive(cls, v: str) -> str:
        v = v.strip().lower().replace("-", "_")
        if v not in DEDUP_DERIVE:
            raise ValueError(f"unknown dedup key derivation {v!r}; choose one of {', '.join(DEDUP_DERIVE)}")
        return v

    @field_validator("message_delay_level")
    @classmethod
    def _delay_levels(cls, v: str) -> str:
        parse_delay_levels(v)
        return v

    @property
    def delay_levels_ms(self) -> list[int]:
        """The delay of level 1, 2, ... in ms."""
        return parse_delay_levels(self.message_delay_level)

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _metrics_port(cls, v: object) -> int | None:
        # Checked by hand rather than by Field bounds, so the message says how to turn it off.
        if v is None:
            return None
        rule = "must be a TCP port from 1 to 65535, or unset for no metrics endpoint"
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            if not (v.isascii() and v.isdigit()):
                raise ValueError(rule)
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
            raise ValueError(rule)
        return v

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, v: str) -> str:
        v = v.strip()
        try:
            ipaddress.ip_address(v)
        except ValueError:
            if not _HOSTNAME_RE.fullmatch(v):
                raise ValueError("must be an IP address (0.0.0.0, 127.0.0.1, ::) or a host name") from None
        return v

    @model_validator(mode="after")
    def _relations(self) -> Settings:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}s) must be longer than heartbeat_interval "
                f"({self.heartbeat_interval}s), or every client looks dead between two beats"
            )
        linger_s = self.consume_linger_ms / 1000
        if linger_s and linger_s * 2 > min(self.run_lease, self.lock_max_live_time):
            raise ValueError(
                f"consume_linger_ms ({self.consume_linger_ms} ms) must be at most half of run_lease "
                f"({self.run_lease}s) and of lock_max_live_time ({self.lock_max_live_time}s): a lingering "
                "request renews neither, so its run must not lapse while it waits"
            )
        if {"retention_min_ms", "retention_ms"} <= self.model_fields_set and self.retention_min_ms > self.retention_ms:
            raise ValueError(
                f"retention_min_ms ({self.retention_min_ms} ms) must not exceed retention_ms "
                f"({self.retention_ms} ms): what is kept for replay cannot outlive the retention itself"
            )
        if self.lock_interval >= self.lock_max_live_time:
            raise ValueError(
                f"lock_interval ({self.lock_interval}s) must be shorter than lock_max_live_time "
                f"({self.lock_max_live_time}s), or leases lapse between renewals"
            )
        return self

    @property
    def effective_celery_broker_url(self) -> str:
        return self.celery_broker_url or self.redis_url

    @property
    def celery_transport(self) -> str:
        """``redis`` or ``amqp`` (RabbitMQ): the kind of Celery's broker, whose settings differ."""
        return celery_transport(self.effective_celery_broker_url)

    @property
    def listener_modules(self) -> list[str]:
        return [m.strip() for m in self.listeners.split(",") if m.strip()]

    @property
    def retention_defaults(self) -> RetentionRule:
        """The retention rule of a topic that chose nothing itself."""
        # A default replay window longer than the retention is cut to it (a short MQORDER_RETENTION_MS
        # alone must not need MQORDER_RETENTION_MIN_MS too); both given and at odds is refused above.
        return RetentionRule(RetentionPolicy(self.retention_policy), self.retention_ms,
                             min(self.retention_min_ms, self.retention_ms), self.retention_max_messages)

    def ms(self, seconds: float) -> int:
        return int(seconds * 1000)

    def describe(self) -> dict[str, Any]:
        """Settings as a dict with every password redacted (what ``mqorder config`` prints)."""
        d = self.model_dump()
        d["redis_url"] = redact_url(self.redis_url)
        if self.celery_broker_url:
            d["celery_broker_url"] = redact_url(self.celery_broker_url)
        d["brokers"] = {k: redact_url(u) for k, u in self.brokers.items()}
        return d


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "settings"
        var = f"MQORDER_{loc.upper()}" if loc != "settings" else "settings"
        given = err.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        if "url" in loc:
            shown = ""
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        lines.append(f"{var}: {msg}{shown}")
    return "invalid mqorder settings:\n  " + "\n  ".join(lines)


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment plus keyword overrides; raise ``ConfigError`` if bad."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None
    except (json.JSONDecodeError, ValueError) as exc:  # a malformed JSON env var
        raise ConfigError(f"invalid mqorder settings: {exc}") from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once; call ``get_settings.cache_clear()`` in tests)."""
    return load_settings()
