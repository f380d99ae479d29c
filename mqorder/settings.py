"""Settings, read from ``MQORDER_*`` environment variables, with RocketMQ's defaults.

Every value is validated once at start; a bad one raises ``ConfigError`` naming the variable, the
value given and what is allowed, instead of failing deep inside a worker an hour later.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import logging
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from functools import lru_cache
from typing import Any, get_args

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mqorder.client.dedup import DedupDerive
from mqorder.errors import ConfigError
from mqorder.names import check_broker
from mqorder.rebalance.allocate import DEFAULT_VIRTUAL_NODES, AllocateStrategy
from mqorder.retention.policy import RetentionPolicy, RetentionRule
from mqorder.store.brokers import (
    DEFAULT_BROKER_NAME,
    celery_transport,
    check_celery_broker_url,
    check_redis_url,
    is_kombu_sentinel_url,
    redact_url,
)
from mqorder.store.durable import parse_wait_replicas
from mqorder.store.urls import with_sentinel_password

log = logging.getLogger(__name__)

_DELAY_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


#: The longest delay level: past it a typo (``999999999999d``) held messages for ever, unnoticed.
MAX_DELAY_LEVEL_MS = 366 * 86_400_000


def parse_delay_levels(text: str) -> list[int]:
    """RocketMQ's ``messageDelayLevel`` ("1s 5s 10s 30s 1m ... 2h") as ms per level; ``ms`` is
    accepted too ("200ms"), for fast retries in tests and latency-sensitive retry topics."""
    out = []
    for item in text.split():
        num, unit = (item[:-2], 1) if item.endswith("ms") else (item[:-1], _DELAY_UNITS.get(item[-1:]))
        if unit is None or not num.isdigit() or int(num) <= 0:
            raise ValueError(f"delay level {item!r} is not a positive number followed by ms, s, m, h or d "
                             "(e.g. '1s 5s 1m')")
        if int(num) * unit > MAX_DELAY_LEVEL_MS:
            raise ValueError(f"delay level {item!r} is longer than 366 days: a message held that long belongs in "
                             "your scheduler, not in a retry or delay level")
        out.append(int(num) * unit)
    if not out:
        raise ValueError("needs at least one level, e.g. '1s 5s 10s 30s 1m'")
    return out


#: Settings renamed when every duration became integer milliseconds: old name -> (new name, factor
#: from the old unit to ms). An old variable still set must stop the start, not be ignored: a
#: worker silently back on the defaults (a 3 s liveness instead of the 30 s you chose) is worse.
RENAMED: dict[str, tuple[str, int]] = {
    **{old: (f"{old}_ms", 1000) for old in (
        "lock_max_live_time", "lock_interval", "client_lock_expire", "rebalance_interval", "heartbeat_interval",
        "heartbeat_timeout", "sweep_interval", "pending_ttl", "run_lease", "max_time_consume_continuously",
        "retention_interval", "send_msg_timeout", "dedup_window", "delay_move_interval", "transaction_timeout",
        "transaction_check_interval",
    )},
    "suspend_current_queue_time_millis": ("suspend_current_queue_time_ms", 1),
}
ENV_PREFIX = "MQORDER_"


def _in_ms(value: object, factor: int) -> str:
    """The old value in the new unit, as the user should write it; ``<milliseconds>`` if it does not parse."""
    try:
        ms = float(str(value).strip()) * factor
    except ValueError:
        return "<milliseconds>"
    return str(round(ms))


def renamed_settings(environ: Mapping[str, str], given: Mapping[str, object]) -> list[str]:
    """One message per renamed setting still used, as a variable or a keyword, naming its
    replacement and the value converted to it."""
    upper = {k.upper(): v for k, v in environ.items()}
    out = []
    for old, (new, factor) in RENAMED.items():
        old_var, new_var = f"{ENV_PREFIX}{old.upper()}", f"{ENV_PREFIX}{new.upper()}"
        if old_var in upper:
            out.append(f"{old_var} was renamed {new_var} (milliseconds): set "
                       f"{new_var}={_in_ms(upper[old_var], factor)} and remove {old_var}")
        if old in given:
            out.append(f"setting {old!r} was renamed {new!r} (milliseconds): pass "
                       f"{new}={_in_ms(given[old], factor)}")
    return out


def unknown_settings(given: Mapping[str, object]) -> list[str]:
    """One message per keyword that names no setting, with the closest names. Variables are only
    warned about (``unknown_variables``): other tools may share the ``MQORDER_`` prefix, but a
    keyword is meant for these settings, and a misspelt one ignored left its setting on the default."""
    known = Settings.model_fields
    out = []
    for name in given:
        if name in known or name in RENAMED or name.startswith("_"):  # _env_file and the like: pydantic's
            continue
        close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
        out.append(f"unknown setting {name!r}" + (f"; did you mean {' or '.join(map(repr, close))}?" if close else
                                                  "; the settings are listed in docs/SETTINGS.md"))
    return out


#: ``MQORDER_*`` variables of this project that are not settings: the demo's and the examples'
#: topic and group, the compose images (``deploy/compose/build_images.sh``), and the test suite's
#: hooks. Known here so that only a variable that names nothing is reported.
OTHER_VARIABLES = frozenset({
    "MQORDER_DEMO_TOPIC", "MQORDER_DEMO_GROUP",                              # mqorder.examples.order_lifecycle
    "MQORDER_ASYNC_EXAMPLE_TOPIC", "MQORDER_ASYNC_EXAMPLE_GROUP",            # mqorder.examples.async_orders
    "MQORDER_IMAGE", "MQORDER_SOURCE_IMAGE", "MQORDER_BASE_IMAGE",           # docker compose
    "MQORDER_SPARK_MASTER",                                                  # the Spark docs and jobs
    "MQORDER_TEST_LEDGER_URL", "MQORDER_TEST_PAUSE", "MQORDER_TEST_DJANGO_DB",  # tests/
})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One message per ``MQORDER_*`` variable that names no setting (nor a renamed one, nor one of
    ``OTHER_VARIABLES``), with the closest setting variables: a misspelt one
    (``MQORDER_CONSUME_BATCH_SISE``) otherwise leaves its setting on the default without a word.
    Only warned about, not refused: other tools may share the prefix."""
    stems = [name.upper() for name in Settings.model_fields]
    known = {ENV_PREFIX + stem for stem in stems}
    renamed = {f"{ENV_PREFIX}{old.upper()}" for old in RENAMED}  # refused with their new name instead
    out = []
    for var in sorted(environ):
        upper = var.upper()  # pydantic-settings reads the variables case-insensitively
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in renamed or upper in OTHER_VARIABLES:
            continue
        # Compared without the prefix they all share, which would make any two names look close.
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), stems, n=3, cutoff=0.6)
        out.append(var + (f" (did you mean {' or '.join(ENV_PREFIX + c for c in close)}?)" if close else ""))
    return out


#: Unknown variables already warned about in this process: each is said once, not at every
#: ``load_settings`` (a producer per request would repeat it in every log line).
_warned_variables: set[str] = set()


def warn_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log a WARNING naming the ``MQORDER_*`` variables that are no setting (``unknown_variables``),
    those not yet named in this process; returns every one found, for ``mqorder config``."""
    found = unknown_variables(os.environ if environ is None else environ)
    new = [v for v in found if v not in _warned_variables]
    if new:
        _warned_variables.update(new)
        log.warning("mqorder: %s no setting and %s ignored: %s. The settings are listed in docs/SETTINGS.md",
                    "this variable names" if len(new) == 1 else "these variables name",
                    "is" if len(new) == 1 else "are", "; ".join(new))
    return found


def _choice(enum: type[StrEnum], value: object, what: str) -> object:
    """Normalise a string choice (``Averagely-By-Circle``) and refuse an unknown one listing the choices."""
    if isinstance(value, enum) or not isinstance(value, str):
        return value
    v = value.strip().lower().replace("-", "_")
    if v not in enum.__members__.values():
        raise ValueError(f"unknown {what} {v!r}; choose one of {', '.join(m.value for m in enum)}")
    return enum(v)


#: A DNS host name (RFC 1123 labels), for ``metrics_addr`` when it is not an IP address.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")


def _numeric(annotation: object) -> bool:
    """Whether a field holds a number (``int``, ``float``, or either or None), not a bool."""
    return annotation in (int, float) or (bool not in get_args(annotation)
                                          and any(a in (int, float) for a in get_args(annotation)))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MQORDER_", extra="ignore", validate_default=True)

    # -- where things are ------------------------------------------------------------------------
    #: The default broker (``broker-a``): ``rediss://`` for TLS, ``redis://:password@host`` or
    #: ``redis://user:password@host`` for AUTH, ``unix:///path`` for a socket, or a Sentinel
    #: deployment: ``redis+sentinel://[:password@]host:port,host:port/<master-name>[/<db>]``
    #: (``mqorder.store.urls``), whose client follows the primary across failovers. TLS options
    #: (``?ssl_ca_certs=/path/ca.pem``): "TLS" below the table.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Celery's own broker; defaults to ``redis_url``. Redis or RabbitMQ (``amqp://``): it carries
    #: only mqorder's tasks, the store stays in Redis (docs/OPERATING.md, "Choosing Celery's broker").
    #: A ``redis+sentinel://`` store URL gives Celery kombu's Sentinel transport (``mqorder.celery.broker``).
    celery_broker_url: str | None = None
    #: The Sentinels' own password (their ``requirepass``), for every ``redis+sentinel://`` URL
    #: whose query names none (``?sentinel_password=`` wins). Not the data nodes' password, which
    #: is the URL's ``user:password@``. Folded into those URLs when settings are read, so a URL
    #: handed to another process (a Spark executor) still carries it.
    sentinel_password: str | None = None
    #: The master name of Celery's broker when ``celery_broker_url`` is kombu's own Sentinel form
    #: (``sentinel://h1:26379;sentinel://h2:26379``, which has no place for it): kombu's
    #: ``master_name``. Not needed with ``redis+sentinel://.../<master-name>``.
    celery_sentinel_master: str | None = None
    #: More named brokers, as JSON: ``{"broker-b": "redis://host:6380/0"}``; not ``broker-a``,
    #: the default broker's name (its URL is ``redis_url``).
    brokers: dict[str, str] = Field(default_factory=dict)
    #: Comma-separated import paths of modules holding ``@orderly_listener`` functions.
    listeners: str = ""

    # -- rebalance and locks (RocketMQ defaults) ------------------------------------------------
    #: How a rebalance shares a topic's queues among a group's live clients: ``averagely``,
    #: ``averagely_by_circle``, ``by_config``, ``by_machine_room`` or ``consistent_hash`` (RocketMQ's five).
    allocate_strategy: AllocateStrategy = AllocateStrategy.AVERAGELY
    #: ByConfig: JSON ``{"client id": ["topic:broker:qid", ...]}``.
    allocate_config: dict[str, list[str]] = Field(default_factory=dict)
    #: ByMachineRoom: JSON list of consuming machine rooms; a broker named ``room@name`` is in ``room``.
    allocate_machine_rooms: list[str] = Field(default_factory=list)
    #: ConsistentHash: virtual nodes per client on the hash ring.
    consistent_hash_virtual_nodes: int = Field(DEFAULT_VIRTUAL_NODES, ge=1, le=1000)
    #: Milliseconds a queue lock (lease) lives without renewal (RocketMQ's broker lockMaxLiveTime, 60 s).
    lock_max_live_time_ms: int = Field(60_000, gt=0, le=3_600_000)  # broker lockMaxLiveTime
    #: Milliseconds between two renewals of a client's locks, ``lock_all`` (REBALANCE_LOCK_INTERVAL, 20 s).
    lock_interval_ms: int = Field(20_000, gt=0, le=3_600_000)  # REBALANCE_LOCK_INTERVAL
    #: Milliseconds a client trusts its own lock without asking Redis again, capped at half the
    #: heartbeat timeout (the client's REBALANCE_LOCK_MAX_LIVE_TIME, 30 s).
    client_lock_expire_ms: int = Field(30_000, gt=0, le=3_600_000)  # REBALANCE_LOCK_MAX_LIVE_TIME
    #: Replicas that must acknowledge a new lock epoch (Redis ``WAIT``) before a run calls the
    #: listener under it: after a failover to one of them the grant survives and nobody else is
    #: granted the queue (the epoch fence holds either way). Unset: 1 on a ``redis+sentinel://``
    #: broker, 0 on a plain one (a standalone Redis has no replica to wait for).
    lock_wait_replicas: int | None = Field(None, ge=0, le=16)
    #: Milliseconds one ``WAIT`` for ``lock_wait_replicas`` may take; short of acknowledgements the
    #: run does not start and is dispatched again a moment later (the grant is retried, not used).
    lock_wait_timeout_ms: int = Field(500, gt=0, le=60_000)
    #: Milliseconds between beat's rebalances (workers also rebalance at once on a join or a leave).
    rebalance_interval_ms: int = Field(20_000, gt=0, le=3_600_000)
    #: Milliseconds between two heartbeats of a client (liveness, for fast failover).
    heartbeat_interval_ms: int = Field(1000, gt=0, le=60_000)
    #: Milliseconds without a heartbeat after which a client counts as gone and its queues move at once.
    heartbeat_timeout_ms: int = Field(3000, gt=0, le=600_000)
    #: Milliseconds between two sweeps for queues with a backlog and no live ConsumeRequest (lost tasks).
    sweep_interval_ms: int = Field(2000, gt=0, le=600_000)
    #: Milliseconds a dispatched but not yet started ConsumeRequest may wait before the sweep replaces it.
    pending_ttl_ms: int = Field(10_000, gt=0, le=3_600_000)
    #: Milliseconds a running ConsumeRequest's claim lives without a fenced call renewing it.
    run_lease_ms: int = Field(60_000, gt=0, le=3_600_000)

    # -- consumption (RocketMQ defaults) --------------------------------------------------------
    #: Messages read per pull (one Redis call), RocketMQ's pullBatchSize.
    pull_batch_size: int = Field(32, ge=1, le=1024)
    #: Messages per listener call (RocketMQ's consumeMessageBatchMaxSize).
    consume_message_batch_max_size: int = Field(1, ge=1, le=1024)
    #: Flow control: most messages held in a queue's ProcessQueue at once (pullThresholdForQueue).
    pull_threshold_for_queue: int = Field(1000, ge=1)
    #: Milliseconds a queue waits before a suspended batch is retried (suspendCurrentQueueTimeMillis).
    suspend_current_queue_time_ms: int = Field(1000, ge=10, le=30_000)
    #: Milliseconds a ConsumeRequest may run before it yields its slot (MAX_TIME_CONSUME_CONTINUOUSLY, 60 s).
    max_time_consume_continuously_ms: int = Field(60_000, gt=0, le=3_600_000)
    #: Milliseconds a ConsumeRequest with a backlog keeps its pool slot while another request of its
    #: worker waits for one; then it re-queues itself behind it (0: only at
    #: ``max_time_consume_continuously_ms``, as RocketMQ). Pool slots are shared by every group
    #: of a worker, where RocketMQ gives each group its own threads: one lagging group held them
    #: for 60 s at a time, and the other groups' queues waited minutes.
    consume_yield_after_ms: int = Field(1000, ge=0, le=3_600_000)
    #: Retries of a failing message before it goes to ``%DLQ%<group>`` (``-1``: never).
    max_reconsume_times: int = Field(16, ge=-1)
    #: How long a drained ConsumeRequest waits for more messages before ending its run, while its
    #: worker has idle pool slots (threads and prefork pools; never solo). It gives the slot back
    #: once another request has waited for one ``capacity.YIELD_AFTER_S`` (25 ms: its lingering
    #: read is nudged then), or when the queue is reassigned (within a 100 ms read slice).
    consume_linger_ms: int = Field(1000, ge=0, le=10_000)
    #: While it lingers, a drained request also watches every other idle queue that its client
    #: owns, of every group with a listener in the process (a send to one rings the worker's
    #: doorbell), and runs whichever gets a message first, with that group's listener, claimed
    #: through begin.lua: with fewer pool slots than queues, sends to idle queues then skip the
    #: wake-up and the new Celery task. Off: it watches its own queue only.
    consume_linger_idle_queues: bool = True
    #: Key-ordered listeners (``@orderly_listener(ordering="key")``): at most this many keys of one
    #: queue are handled at once (one call per key at a time, in offset order per key).
    key_concurrency: int = Field(16, ge=1, le=1024)
    #: ``async def`` listeners: at most this many calls of all the runs of one worker process in
    #: flight at once on its event loop; a call past it waits for a place before its listener
    #: starts (``key_concurrency`` still bounds each queue).
    async_max_in_flight: int = Field(10_000, ge=1, le=1_000_000)
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
    retention_policy: RetentionPolicy = RetentionPolicy.TIME
    #: Default retention in ms of topics that set none (72 h); ledger records older than it are trimmed too.
    retention_ms: int = Field(72 * 3600 * 1000, ge=1000, le=366 * 24 * 3600 * 1000)
    #: ``consumed`` keeps at least this long of consumed messages, for replay.
    retention_min_ms: int = Field(3600 * 1000, ge=0, le=366 * 24 * 3600 * 1000)
    #: Most messages kept per queue (0: no cap).
    retention_max_messages: int = Field(0, ge=0)
    #: Milliseconds between two trim passes of a worker's housekeeping (one worker per interval does it).
    retention_interval_ms: int = Field(5000, gt=0, le=3_600_000)
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
    #: Largest body, in bytes (4 MiB). A producer refuses a larger one with a clear error; a
    #: consumer dead-letters a stored body over its own limit at once (``DLQ_REASON`` names both
    #: sizes), so raise it on the workers too before a producer's.
    max_message_size: int = Field(4 * 1024 * 1024, ge=1, le=512 * 1024 * 1024)
    #: Milliseconds a producer waits for one send (sendMsgTimeout, 3 s).
    send_msg_timeout_ms: int = Field(3000, gt=0, le=600_000)
    #: Extra attempts of a failed send, on another broker where there is one (retryTimesWhenSendFailed).
    retry_times_when_send_failed: int = Field(2, ge=0, le=16)
    #: Milliseconds a producer dedup key is remembered per queue (SQS FIFO's 5 minutes): a resend of
    #: the same key within it returns the first send's result and stores nothing.
    dedup_window_ms: int = Field(300_000, gt=0, le=86_400_000)
    #: The dedup key of a send that names none: ``none`` (only ``dedup_key=`` deduplicates),
    #: ``msg_id`` (every send is keyed by its own id: the producer's retries never duplicate) or
    #: ``content`` (the body's SHA-256, SQS's content-based deduplication).
    dedup_derive: DedupDerive = DedupDerive.NONE
    #: Replicas that must have a send before it is acknowledged (Redis ``WAIT`` after the append,
    #: in the same round trip; ``wait_replicas=`` of a send wins): a send acknowledged so survives
    #: a failover to one of them. 0: do not wait (replication is asynchronous, and an acknowledged
    #: send can be lost when a replica that lacks it is promoted). At most 16. ``mqorder doctor``
    #: says which.
    send_wait_replicas: int = 0
    #: Milliseconds a send waits for ``send_wait_replicas``; short of them it raises
    #: ``ReplicasBehindError`` (stored on the primary, not yet safe from a failover).
    send_wait_timeout_ms: int = Field(1000, gt=0, le=600_000)

    # -- delay messages (RocketMQ's messageDelayLevel) -----------------------------------------
    #: The delay of each ``delay_time_level`` (1 = the first), RocketMQ's broker default; each at
    #: most 366 days.
    message_delay_level: str = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
    #: Milliseconds between two moves of due delayed messages into their queues by each worker's client.
    delay_move_interval_ms: int = Field(1000, gt=0, le=3_600_000)

    # -- transactional messages (RocketMQ's broker defaults) -----------------------------------
    #: Milliseconds after phase one before a half message is first checked back (transactionTimeout, 6 s).
    transaction_timeout_ms: int = Field(6000, gt=0, le=86_400_000)
    #: Checked back at most this many times, then rolled back with that reason (transactionCheckMax).
    transaction_check_max: int = Field(15, ge=1, le=1000)
    #: Milliseconds between two runs of the check-back beat task (transactionCheckInterval, 60 s).
    transaction_check_interval_ms: int = Field(60_000, gt=0, le=86_400_000)

    def __init__(self, **values: Any) -> None:
        # Checked before pydantic reads anything: with ``extra="ignore"`` it would drop an old name
        # without a word, and its own errors would blame the settings rather than the variable.
        problems = renamed_settings(os.environ, values)
        problems += unknown_settings(values)
        if problems:
            raise ConfigError("invalid mqorder settings:\n  " + "\n  ".join(problems))
        warn_unknown_variables()
        super().__init__(**values)

    def with_overrides(self, **overrides: Any) -> Settings:
        """These settings with ``overrides`` on top, validated again (``"Content"`` becomes
        ``DedupDerive.CONTENT``). Only the fields given to these settings (by variable or keyword)
        are passed on as given: passing every field marked each one as chosen by the user, and a
        check of two chosen values (``retention_min_ms`` against ``retention_ms``) then failed on
        a default the user never set."""
        given = self.model_dump(include=self.model_fields_set)
        return load_settings(**{**given, **overrides})

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
            # Checked here, not at the first send to that broker: a bad name (and the default
            # broker's own, whose URL the registry would have dropped) stops the start.
            if name == DEFAULT_BROKER_NAME:
                raise ValueError(
                    f"names {DEFAULT_BROKER_NAME!r}, the default broker's own name: the default broker is "
                    f"MQORDER_REDIS_URL. Give this broker another name (\"broker-b\"), or set MQORDER_REDIS_URL "
                    "to its URL and leave it out of MQORDER_BROKERS")
            check_broker(name)
            check_redis_url(url, f"MQORDER_BROKERS[{name!r}]")
        return v

    @field_validator("sentinel_password", "celery_sentinel_master")
    @classmethod
    def _empty_is_unset(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        """A bool given for a number (``retry_times_when_send_failed=True``) is refused, not read
        as 1: it is almost always a setting confused with another."""
        if isinstance(data, Mapping):
            # Fields with a validator of their own say it in their own words.
            own = {f for v in cls.__pydantic_decorators__.field_validators.values() for f in v.info.fields}
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and name not in own and _numeric(field.annotation):
                    raise ValueError(f"{name} (MQORDER_{name.upper()}) must be a number, got {value!r}")
        return data

    @model_validator(mode="after")
    def _sentinel(self) -> Settings:
        """Sentinel URLs: the Sentinel password goes into each URL that needs it, and kombu's
        ``sentinel://`` form of Celery's broker needs its master name."""
        if self.sentinel_password:
            self.redis_url = with_sentinel_password(self.redis_url, self.sentinel_password)
            self.brokers = {k: with_sentinel_password(u, self.sentinel_password) for k, u in self.brokers.items()}
            if self.celery_broker_url:
                self.celery_broker_url = with_sentinel_password(self.celery_broker_url, self.sentinel_password)
        if self.celery_broker_url and is_kombu_sentinel_url(self.celery_broker_url) and not self.celery_sentinel_master:
            raise ValueError(
                "MQORDER_CELERY_BROKER_URL is kombu's sentinel:// form, which cannot name the master the "
                "Sentinels monitor: set MQORDER_CELERY_SENTINEL_MASTER=<master-name>, or write the URL as "
                "redis+sentinel://host:port,host:port/<master-name>"
            )
        return self

    @field_validator("allocate_strategy", mode="before")
    @classmethod
    def _strategy(cls, v: object) -> object:
        return _choice(AllocateStrategy, v, "strategy")

    @field_validator("retention_policy", mode="before")
    @classmethod
    def _retention_policy(cls, v: object) -> object:
        return _choice(RetentionPolicy, v, "retention policy")

    @field_validator("dedup_derive", mode="before")
    @classmethod
    def _dedup_derive(cls, v: object) -> object:
        return _choice(DedupDerive, v, "dedup key derivation")

    @field_validator("send_wait_replicas", mode="before")
    @classmethod
    def _send_wait_replicas(cls, v: object) -> int:
        return parse_wait_replicas(v)

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
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms} ms) must be longer than heartbeat_interval_ms "
                f"({self.heartbeat_interval_ms} ms), or every client looks dead between two beats"
            )
        if self.consume_linger_ms and self.consume_linger_ms * 2 > min(self.run_lease_ms, self.lock_max_live_time_ms):
            raise ValueError(
                f"consume_linger_ms ({self.consume_linger_ms} ms) must be at most half of run_lease_ms "
                f"({self.run_lease_ms} ms) and of lock_max_live_time_ms ({self.lock_max_live_time_ms} ms): a "
                "lingering request renews neither, so its run must not lapse while it waits"
            )
        if {"retention_min_ms", "retention_ms"} <= self.model_fields_set and self.retention_min_ms > self.retention_ms:
            raise ValueError(
                f"retention_min_ms ({self.retention_min_ms} ms) must not exceed retention_ms "
                f"({self.retention_ms} ms): what is kept for replay cannot outlive the retention itself"
            )
        if self.send_wait_replicas and self.send_wait_timeout_ms >= self.send_msg_timeout_ms:
            raise ValueError(
                f"send_wait_timeout_ms ({self.send_wait_timeout_ms} ms) must be shorter than send_msg_timeout_ms "
                f"({self.send_msg_timeout_ms} ms): the send's WAIT would outlast the socket's read, and a send "
                "that IS stored would be reported as not answered"
            )
        if self.lock_interval_ms >= self.lock_max_live_time_ms:
            raise ValueError(
                f"lock_interval_ms ({self.lock_interval_ms} ms) must be shorter than lock_max_live_time_ms "
                f"({self.lock_max_live_time_ms} ms), or leases lapse between renewals"
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
        return RetentionRule(self.retention_policy, self.retention_ms,
                             min(self.retention_min_ms, self.retention_ms), self.retention_max_messages)

    def describe(self) -> dict[str, Any]:
        """Settings as a dict with every password redacted (what ``mqorder config`` prints)."""
        d = self.model_dump(mode="json")
        d["redis_url"] = redact_url(self.redis_url)
        if self.celery_broker_url:
            d["celery_broker_url"] = redact_url(self.celery_broker_url)
        d["brokers"] = {k: redact_url(u) for k, u in self.brokers.items()}
        if self.sentinel_password:
            d["sentinel_password"] = "***"
        return d


#: What a boolean setting accepts (pydantic's words for true and false), for its error.
_BOOL_WORDS = "true or false (also 1/0, yes/no, on/off, t/f, y/n)"


def _variable(loc: tuple[int | str, ...]) -> str:
    """The variable an error is about, with the place inside its JSON value as written there:
    ``MQORDER_ALLOCATE_CONFIG['w1'][0]`` (the key as given: client ``w1`` is not ``W1``)."""
    if not loc:
        return "settings"
    inner = "".join(f"[{p}]" if isinstance(p, int) else f"[{p!r}]" for p in loc[1:])
    return f"{ENV_PREFIX}{str(loc[0]).upper()}{inner}"


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        given = err.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        if loc and ("url" in str(loc[0]) or loc[0] == "brokers"):  # a URL may hold a password
            shown = ""
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") in ("bool_parsing", "bool_type"):
            msg = f"must be {_BOOL_WORDS}"
        lines.append(f"{_variable(loc)}: {msg}{shown}")
    return "invalid mqorder settings:\n  " + "\n  ".join(lines)


#: An example value of each setting that takes JSON from the environment (pydantic-settings parses
#: a dict or list field's variable as JSON before any validator runs).
_JSON_EXAMPLES = {
    "brokers": '{"broker-b": "redis://host-b:6379/0"}',
    "allocate_config": '{"w1@host": ["orders:broker-a:0", "orders:broker-a:1"]}',
    "allocate_machine_rooms": '["room-a", "room-b"]',
}


def _explain_json(exc: ValueError) -> str:
    """pydantic-settings' own text names neither the variable nor the form it wants ("error parsing
    value for field "brokers" from source "EnvSettingsSource""): say both."""
    found = re.search(r'field "(\w+)"', str(exc))
    if found is None:
        return f"invalid mqorder settings: {exc}"
    name = found.group(1)
    cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
    example = _JSON_EXAMPLES.get(name)
    form = f", e.g. MQORDER_{name.upper()}='{example}'" if example else ""
    return f"invalid mqorder settings:\n  MQORDER_{name.upper()}: not valid JSON{cause}; it takes a JSON value{form}"


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment plus keyword overrides; raise ``ConfigError`` if bad."""
    try:
        return Settings(**overrides)
    except ConfigError:  # already said what was wrong (a renamed or unknown setting)
        raise
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None
    except (json.JSONDecodeError, ValueError) as exc:  # a malformed JSON env var
        raise ConfigError(_explain_json(exc)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once; call ``get_settings.cache_clear()`` in tests)."""
    return load_settings()
