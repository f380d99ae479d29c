"""Options of the ``mqorder`` Spark data source, parsed and checked once, before anything runs.

Spark lower-cases option names on their way to a Python data source (``orderBy`` arrives as
``orderby``), so names are matched without case; values keep theirs. An unknown option is refused
with the list of known ones: a misspelt ``orderBy`` silently ignored would publish out of order.

Connections are described here (a URL, picklable) and opened on the executor, inside ``write()`` or
``read()``: a Redis client cannot be pickled into a task.

Write options (``_WRITE``; a typo is refused listing them): ``topic``, ``key``, ``orderBy``,
``body`` (a column, or ``json``: the whole row), ``idColumn``, ``onNull`` (``fail`` | ``skip``),
``redisUrl``, ``brokers`` (JSON), ``maxMessageSize``, ``stagingTtl`` (seconds), ``stageChunk``
(rows per staging call), ``jobId``, and ``waitReplicas``: the replicas every broker's primary must
have the published rows on before the commit returns (Redis ``WAIT``, ``mqorder.store.durable``;
default ``MQORDER_SEND_WAIT_REPLICAS``, read where the plan is built; 0: do not wait), with
``waitTimeoutMs`` (default ``MQORDER_SEND_WAIT_TIMEOUT_MS``). Short of them the job fails with
``ReplicasBehindError``: its rows ARE published, and running the job again stores nothing twice
(ids) and waits again. More replicas than a broker has connected refuse the job before anything
is published.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.names import check_topic
from mqorder.settings import Settings, get_settings, load_settings
from mqorder.store.brokers import BrokerRegistry, check_redis_url
from mqorder.store.durable import SendWait, parse_wait_replicas
from mqorder.store.failures import REDIS_ERRORS, setup_hint

#: ``onNull``: refuse the whole job (the default) or leave such rows out, counted in the report.
ON_NULL = ("fail", "skip")
#: ``body``: this value means "the whole row as JSON" rather than a column name.
BODY_JSON = "json"
#: Staged rows of a job that never commits expire after this long (option ``stagingTtl``, seconds).
DEFAULT_STAGING_TTL_S = 6 * 3600
#: Rows per staging call; several calls are pipelined per round trip (option ``stageChunk``).
DEFAULT_STAGE_CHUNK = 1000
#: ``stage.lua`` unpacks four values per row into one ``RPUSH``; Lua unpacks at most 8,000.
MAX_STAGE_CHUNK = 1500
#: A read's Spark partitions hold at most this many offsets each (``maxRowsPerPartition``).
DEFAULT_MAX_ROWS_PER_PARTITION = 250_000

#: Options Spark itself sets or reads (``save(path)``, a stream's checkpoint): not ours to refuse.
_SPARK = ("path", "checkpointlocation", "queryname")
_COMMON = ("topic", "redisurl", "brokers", *_SPARK)
_WRITE = (*_COMMON, "key", "orderby", "body", "idcolumn", "onnull", "stagingttl", "stagechunk", "jobid",
          "maxmessagesize", "waitreplicas", "waittimeoutms")
_READ = (*_COMMON, "startingoffsets", "endingoffsets", "maxrowsperpartition", "minpartitions", "maxoffsetspertrigger",
         "maxmessagesize")
_SPELLING = {
    "redisurl": "redisUrl", "orderby": "orderBy", "idcolumn": "idColumn", "onnull": "onNull",
    "stagingttl": "stagingTtl", "stagechunk": "stageChunk", "jobid": "jobId", "maxmessagesize": "maxMessageSize",
    "startingoffsets": "startingOffsets", "endingoffsets": "endingOffsets",
    "maxrowsperpartition": "maxRowsPerPartition", "minpartitions": "minPartitions", "maxoffsetspertrigger": "maxOffsetsPerTrigger",
    "orderfield": "orderField", "waitreplicas": "waitReplicas", "waittimeoutms": "waitTimeoutMs",
}


@dataclass(frozen=True)
class Connection:
    """Where the topic lives: the default broker's URL, any extra named brokers, and limits."""

    redis_url: str
    brokers: dict[str, str] = field(default_factory=dict)
    max_message_size: int = 4 * 1024 * 1024
    pending_ttl_ms: int = 10_000
    timeout: float = 3.0
    #: ``MQORDER_SEND_WAIT_REPLICAS`` / ``_TIMEOUT_MS`` where the options were read (the driver):
    #: the defaults of option ``waitReplicas``.
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000

    @property
    def socket_timeout(self) -> float:
        """Seconds: Spark's tasks and commits move large chunks, so never less than 10 s."""
        return max(self.timeout, 10.0)

    def registry(self) -> BrokerRegistry:
        return BrokerRegistry(self.redis_url, self.brokers, socket_timeout=self.socket_timeout)

    @classmethod
    def from_settings(cls, settings: Settings) -> Connection:
        return cls(settings.redis_url, dict(settings.brokers), settings.max_message_size,
                   settings.pending_ttl_ms, settings.send_msg_timeout_ms / 1000, settings.send_wait_replicas,
                   settings.send_wait_timeout_ms)


def lower_options(options: Mapping[str, Any]) -> dict[str, str]:
    """Option names without case (Spark lower-cases them on some paths), values as given."""
    return {str(k).lower(): str(v) for k, v in options.items() if v is not None}


def check_known(opts: Mapping[str, str], known: tuple[str, ...], what: str, fmt: str = "mqorder") -> None:
    """Refuse an option none of ``known`` names, listing the known ones as users spell them."""
    unknown = sorted(set(opts) - set(known))
    if unknown:
        names = ", ".join(_SPELLING.get(k, k) for k in known if k not in _SPARK)
        raise ConfigError(f"unknown {what} option(s) {', '.join(map(repr, unknown))} for format('{fmt}'); "
                          f"known options: {names}")


def _int(opts: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = opts.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"option {_SPELLING.get(name, name)}={raw!r} must be an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"option {_SPELLING.get(name, name)}={value} is out of range [{lo}, {hi}]")
    return value


def min_partitions(opts: Mapping[str, str]) -> int | None:
    """The option ``minPartitions`` (read tasks at least, Kafka's name), checked the same for
    every reader: an integer in [1, 100,000]; None when not given."""
    return _int(opts, "minpartitions", 0, 1, 100_000) if opts.get("minpartitions") else None


def connection(opts: Mapping[str, str]) -> Connection:
    """The options ``redisUrl``, ``brokers`` (JSON) and ``maxMessageSize`` if given, else the
    ``MQORDER_*`` settings.

    ``mqorder.spark.publish`` always passes the driver's URL: executors may not see the driver's
    environment.
    """
    overrides: dict[str, Any] = {}
    if opts.get("redisurl"):
        # Checked here under its own name: the settings would name MQORDER_REDIS_URL, which the
        # user did not set (a URL without a scheme was reported as that variable's).
        overrides["redis_url"] = check_redis_url(opts["redisurl"], "option redisUrl")
    if opts.get("maxmessagesize"):
        overrides["max_message_size"] = _int(opts, "maxmessagesize", 0, 1, 512 * 1024 * 1024)
    if opts.get("brokers"):
        try:
            overrides["brokers"] = json.loads(opts["brokers"])
        except ValueError:
            raise ConfigError(f"option brokers must be a JSON object of broker name to URL, got {opts['brokers']!r}") from None
    settings = load_settings(**overrides) if overrides else get_settings()
    return Connection.from_settings(settings)


def topic_of(opts: Mapping[str, str]) -> str:
    topic = opts.get("topic")
    if not topic:
        raise ConfigError("format('mqorder') needs option('topic', <name>)")
    return check_topic(topic, allow_dlq=True, allow_retry=True)


@dataclass(frozen=True)
class WriteOptions:
    topic: str
    key: str
    order_by: str
    body: str
    id_column: str | None
    on_null: str
    staging_ttl_ms: int
    stage_chunk: int
    job_id: str | None
    conn: Connection
    #: A stream's checkpoint location: the stream's job ids derive from it, so they are the same in
    #: every process Spark starts for the query and after a restart.
    checkpoint: str | None = None
    #: What the commit waits for after publishing (option ``waitReplicas``); ``None``: nothing.
    wait: SendWait | None = None


def write_options(options: Mapping[str, Any]) -> WriteOptions:
    opts = lower_options(options)
    check_known(opts, _WRITE, "write")
    topic = topic_of(opts)
    for name in ("key", "orderby"):
        if not opts.get(name):
            raise ConfigError(f"format('mqorder') needs option('{_SPELLING.get(name, name)}', <column>): "
                              + ("the sharding-key column" if name == "key" else
                                 "the column that orders the rows of one key"))
    on_null = opts.get("onnull", "fail").lower()
    if on_null not in ON_NULL:
        raise ConfigError(f"option onNull={on_null!r}: choose fail (refuse the job) or skip (leave such rows out, counted)")
    job_id = opts.get("jobid") or None
    if job_id is not None and not job_id.isalnum():
        raise ConfigError(f"option jobId={job_id!r} must be alphanumeric")
    conn = connection(opts)
    return WriteOptions(
        topic=topic,
        key=opts["key"],
        order_by=opts["orderby"],
        body=opts.get("body") or BODY_JSON,
        id_column=opts.get("idcolumn") or None,
        on_null=on_null,
        staging_ttl_ms=1000 * _int(opts, "stagingttl", DEFAULT_STAGING_TTL_S, 60, 30 * 24 * 3600),
        stage_chunk=_int(opts, "stagechunk", DEFAULT_STAGE_CHUNK, 1, MAX_STAGE_CHUNK),
        job_id=job_id,
        conn=conn,
        checkpoint=opts.get("checkpointlocation") or None,
        wait=_wait(opts, conn),
    )


def _wait(opts: Mapping[str, str], conn: Connection) -> SendWait | None:
    """Option ``waitReplicas``, else ``MQORDER_SEND_WAIT_REPLICAS``; ``None`` for 0."""
    timeout_ms = _int(opts, "waittimeoutms", conn.wait_timeout_ms, 1, 600_000)
    raw = opts.get("waitreplicas")
    if raw is None or raw == "":
        n = conn.wait_replicas
    else:
        try:
            n = parse_wait_replicas(raw)
        except ValueError as exc:
            raise ConfigError(f"option waitReplicas={raw!r} {exc}") from None
    if not n:
        return None
    if timeout_ms >= conn.socket_timeout * 1000:
        raise ConfigError(
            f"waitReplicas={n} waits up to {timeout_ms} ms (waitTimeoutMs / MQORDER_SEND_WAIT_TIMEOUT_MS), which "
            f"must be shorter than the commit's socket timeout ({conn.socket_timeout:g} s, the larger of 10 s and "
            "MQORDER_SEND_MSG_TIMEOUT_MS): lower the one or raise the other"
        )
    return SendWait(n, timeout_ms)


@dataclass(frozen=True)
class ReadOptions:
    topic: str
    starting: str
    ending: str
    max_rows_per_partition: int
    max_offsets_per_trigger: int | None
    conn: Connection
    #: Read tasks at least (``minPartitions``); None: the planning machine's cores.
    min_partitions: int | None = None


def read_options(options: Mapping[str, Any], *, streaming: bool) -> ReadOptions:
    """Kafka's defaults: a batch reads from earliest to latest, a stream starts at latest."""
    opts = lower_options(options)
    check_known(opts, _READ, "read")
    if streaming and "endingoffsets" in opts:
        raise ConfigError("endingOffsets is for batch reads only; a stream reads what is stored as it arrives")
    per_trigger = _int(opts, "maxoffsetspertrigger", 0, 0, 2**62)
    return ReadOptions(
        topic=topic_of(opts),
        starting=opts.get("startingoffsets", "latest" if streaming else "earliest"),
        ending=opts.get("endingoffsets", "latest"),
        max_rows_per_partition=_int(opts, "maxrowsperpartition", DEFAULT_MAX_ROWS_PER_PARTITION, 1, 2**62),
        max_offsets_per_trigger=per_trigger or None,
        conn=connection(opts),
        min_partitions=min_partitions(opts),
    )


@contextmanager
def reachable(what: str) -> Iterator[None]:
    """A Redis that does not answer where the data source plans a job (the driver, Spark's planning
    worker) as ``BrokerUnavailableError`` saying what to do. It was redis-py's ``ConnectionError``
    inside Spark's ``AnalysisException``, about 40 lines of traceback that ``mqorder_error`` could
    not read, and a bare ``ConnectionError`` from ``publish``."""
    try:
        yield
    except REDIS_ERRORS as exc:
        hint = setup_hint(exc) or "start redis-server, or point option redisUrl (or MQORDER_REDIS_URL) at a running one"
        raise BrokerUnavailableError(f"{what}: Redis did not answer ({type(exc).__name__}: {exc}); {hint}") from exc
