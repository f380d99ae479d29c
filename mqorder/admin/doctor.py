"""``mqorder doctor``: checks a deployment against what mqorder's guarantees rest on, and explains.

Each check gives a ``Finding``: OK, WARN (works, but a guarantee is weaker than it could be) or
FAIL (a guarantee does not hold, or sends are being refused). The command exits non-zero on any
FAIL (with ``--strict``, on any WARN too), so it can gate a deploy.

What is checked, per Redis broker, and why:

* **version**: retention trims with ``XTRIM MINID`` (Redis 6.2+); 7.0+ is what the suite runs.
* **persistence**: an acknowledged send survives a Redis crash only with AOF on; ``appendfsync
  everysec`` can lose about a second, ``always`` nothing, ``no`` whatever the OS had not flushed.
* **eviction**: any ``maxmemory-policy`` but ``noeviction`` may delete a stream or a lock hash
  (``mqorder.store.capacity``).
* **memory**: without ``maxmemory`` a full Redis is killed by the OS instead of refusing sends;
  past ``MQORDER_MAX_MEMORY_RATIO`` sends are being refused now.
* **clock**: leases are judged by Redis's clock, but born/handled times in the ledger and the
  audit come from the hosts: this host's and every live worker's skew against Redis.
* **versions**: the mqorder version (and Lua scripts' digest) every live client registered with;
  more than one is a rolling upgrade under way or a worker left behind (WARN).

* **replication and failover** (``mqorder.admin.doctor_ha``): whether it is the primary, its
  replicas and their lag, ``min-replicas-to-write``, what a failover can lose with the current
  settings (``MQORDER_SEND_WAIT_REPLICAS``), and for a ``redis+sentinel://`` URL each Sentinel's
  view and whether a failover can still be authorized.
* **Redis Cluster** (a ``redis+cluster://`` URL, ``mqorder.admin.doctor_cluster``): cluster state,
  slot coverage, replicas per primary, failed nodes, Redis 7 on every node, every queue's keys in
  one slot; then persistence, eviction, memory, ``min-replicas`` and send durability on each
  primary (a queue's data lives on one of them), and the clock once.

And for Celery (when an app's configuration is given): JSON only (a pickle-accepting worker runs
code from the broker), and on a Redis transport a visibility timeout longer than a
ConsumeRequest may run (``MQORDER_RUN_LEASE_MS``), or Redis hands a running request out again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis

from mqorder import keys
from mqorder.admin.doctor_cluster import cluster_findings, probe_cluster
from mqorder.admin.doctor_ha import (
    min_replicas_finding,
    read_min_replicas,
    read_replication,
    replication_findings,
    send_wait_finding,
    sentinel_findings,
)
from mqorder.admin.findings import DoctorReport, Finding, Verdict
from mqorder.settings import Settings
from mqorder.store.brokers import Broker, BrokerRegistry, cluster_celery_broker_error
from mqorder.store.capacity import SAFE_POLICY, eviction_policy, read_memory
from mqorder.store.cluster_urls import is_cluster_url
from mqorder.store.failures import setup_hint
from mqorder.store.replies import text

#: Skew between a host and Redis above which born/handled times stop being comparable.
MAX_SKEW_MS = 1000
#: Redis versions: what retention needs, and what the suite runs.
MIN_VERSION = (6, 2)
GOOD_VERSION = (7, 0)


__all__ = ["DoctorReport", "Finding", "Verdict", "diagnose"]


def diagnose(settings: Settings, brokers: BrokerRegistry, celery_conf: Mapping[str, Any] | None = None,
             celery_error: str = "") -> DoctorReport:
    """Every check; a broker that does not answer is one FAIL, and the others are still checked.

    A broker behind Sentinels gets its Sentinels checked even when no primary answers (that is
    when their view matters most).
    """
    report = DoctorReport()
    for name in brokers.names:
        broker = brokers.get(name)
        if is_cluster_url(broker.url):
            report.findings.extend(_cluster_broker_findings(settings, broker, brokers))
            continue
        try:
            report.findings.extend(_broker_findings(settings, broker))
        except redis.RedisError as exc:
            report.findings.append(Finding(
                "reachable", Verdict.FAIL, f"{broker.safe_url} did not answer: {exc}",
                setup_hint(exc) or "start that redis-server, or fix MQORDER_REDIS_URL / MQORDER_BROKERS", name))
        report.findings.extend(sentinel_findings(broker))
    try:
        report.findings.extend(worker_clocks(brokers, settings))
        report.findings.extend(client_versions(brokers, settings))
    except redis.RedisError:
        pass  # already reported as unreachable
    report.findings.extend(_celery_part(settings, celery_conf, celery_error))
    return report


def diagnose_unreachable(settings: Settings, error: Exception, celery_conf: Mapping[str, Any] | None = None,
                         celery_error: str = "") -> DoctorReport:
    """The report when the brokers could not even be set up (a Redis Cluster whose listed nodes
    all refuse: its client reads the slot map when made): that one FAIL, and Celery's checks, as
    for a plain Redis that does not answer, rather than a bare error and nothing checked."""
    report = DoctorReport([Finding(
        "reachable", Verdict.FAIL, str(error),
        "start the cluster's nodes (or the redis-server), or fix MQORDER_REDIS_URL / MQORDER_BROKERS")])
    report.findings.extend(_celery_part(settings, celery_conf, celery_error))
    return report


def _celery_part(settings: Settings, celery_conf: Mapping[str, Any] | None, celery_error: str) -> list[Finding]:
    if celery_conf is not None:
        return celery_findings(settings, celery_conf)
    if celery_error:
        # A FAIL: workers started with that app fail the same way (a mistyped --app exited 0 with a
        # WARN). --app '' skips the Celery checks on purpose.
        return [Finding("celery", Verdict.FAIL, f"Celery configuration not checked: {celery_error}",
                        "fix the app or its settings, pass --app with your Celery app (module:attribute), or "
                        "--app '' to skip the Celery checks")]
    return []


def _broker_findings(settings: Settings, broker: Broker) -> list[Finding]:
    c = broker.client
    server = c.info("server")
    return [
        version_finding(str(server.get("redis_version", "0")), broker.name),
        persistence_finding(c, broker.name),
        eviction_finding(c, settings, broker.name),
        memory_finding(c, settings, broker.name),
        clock_finding(c, broker.name),
        *replication_findings(c, settings, broker.name),
    ]


def _cluster_broker_findings(settings: Settings, broker: Broker, brokers: BrokerRegistry) -> list[Finding]:
    """The cluster's own checks, then the per-Redis ones on each primary that answers (named
    ``<broker> <host:port>``); the version is the cluster check's (Redis 7 for sharded pub/sub)."""
    probe = probe_cluster(broker.url)
    try:
        # Topic routes are on the default broker: this cluster, or another Redis.
        routes = None if broker.name == brokers.default_name else brokers.meta
        out = cluster_findings(probe, broker.name, routes)
        for i, (addr, c) in enumerate(probe.live_primaries()):
            where = f"{broker.name} {addr}"
            try:
                rep = read_replication(c)
                out += [persistence_finding(c, where), eviction_finding(c, settings, where),
                        memory_finding(c, settings, where), min_replicas_finding(rep, read_min_replicas(c), where),
                        send_wait_finding(rep, settings, where)]
                if i == 0:  # one clock is enough: the cluster's nodes run on hosts of one site
                    out.append(clock_finding(c, broker.name))
            except redis.RedisError as exc:
                out.append(Finding("reachable", Verdict.FAIL, f"{addr} stopped answering: {exc}",
                                   "check that node", where))
        return out
    finally:
        probe.close()


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def version_finding(version: str, broker: str) -> Finding:
    v = _version_tuple(version)
    if v < MIN_VERSION:
        return Finding("version", Verdict.FAIL, f"Redis {version}: retention needs XTRIM MINID (Redis 6.2+)",
                       "upgrade Redis to 7.x", broker)
    if v < GOOD_VERSION:
        return Finding("version", Verdict.WARN, f"Redis {version} works; mqorder is tested on 7.x",
                       "upgrade Redis to 7.x when you can", broker)
    return Finding("version", Verdict.OK, f"Redis {version}", broker=broker)


def persistence_finding(c: redis.Redis, broker: str) -> Finding:
    aof = str(c.info("persistence").get("aof_enabled", 0)) == "1"
    if not aof:
        return Finding("persistence", Verdict.WARN,
                       "AOF is off: sends acknowledged since the last RDB snapshot are lost if Redis crashes",
                       "set `appendonly yes` and `appendfsync everysec` (or always) in redis.conf", broker)
    try:
        fsync = str(c.config_get("appendfsync").get("appendfsync", ""))
    except redis.ResponseError:
        fsync = ""
    if fsync == "no":
        return Finding("persistence", Verdict.WARN,
                       "AOF on with appendfsync no: what the OS had not flushed is lost on a power cut",
                       "set `appendfsync everysec` (about 1 s at risk) or `always` (none)", broker)
    what = {"always": "no acknowledged send is lost on a crash",
            "everysec": "at most about 1 s of acknowledged sends is lost on a power cut"}.get(
        fsync, "appendfsync could not be read (CONFIG disabled)")
    return Finding("persistence", Verdict.OK, f"AOF on, appendfsync {fsync or '?'}: {what}", broker=broker)


def eviction_finding(c: redis.Redis, settings: Settings, broker: str) -> Finding:
    policy, source = eviction_policy(c)
    if not source:
        return Finding("eviction", Verdict.WARN, "maxmemory-policy cannot be read (CONFIG and INFO refused)",
                       "make sure it is noeviction: an evicted stream or lock is silent data loss", broker)
    if policy == SAFE_POLICY:
        return Finding("eviction", Verdict.OK, f"maxmemory-policy {policy}: Redis never deletes a key for room",
                       broker=broker)
    verdict = Verdict.WARN if settings.allow_eviction else Verdict.FAIL
    allowed = " (allowed by MQORDER_ALLOW_EVICTION)" if settings.allow_eviction else "; workers and producers refuse it"
    return Finding("eviction", verdict,
                   f"maxmemory-policy {policy}: Redis may evict a queue's stream or a lock hash{allowed}",
                   "CONFIG SET maxmemory-policy noeviction (and in redis.conf)", broker)


def memory_finding(c: redis.Redis, settings: Settings, broker: str) -> Finding:
    m = read_memory(c)
    used = f"{m.used / 1048576:,.1f} MiB used"
    if not m.maxmemory:
        return Finding("memory", Verdict.WARN,
                       f"{used}, no maxmemory: a full Redis is killed by the OS instead of refusing sends",
                       f"set maxmemory (sends are refused at MQORDER_MAX_MEMORY_RATIO={settings.max_memory_ratio} "
                       "of it) and a retention that fits (`mqorder topic retention`)", broker)
    ratio = m.ratio or 0.0
    detail = f"{used} of {m.maxmemory / 1048576:,.1f} MiB ({ratio:.0%}); sends refused from {settings.max_memory_ratio:.0%}"
    if ratio >= settings.max_memory_ratio:
        return Finding("memory", Verdict.FAIL, detail + ": sends are being refused now (BrokerFullError)",
                       "let consumers drain it, shorten retention, or raise maxmemory", broker)
    if ratio >= 0.9 * settings.max_memory_ratio:
        return Finding("memory", Verdict.WARN, detail + ": close to refusing sends",
                       "shorten retention or raise maxmemory", broker)
    return Finding("memory", Verdict.OK, detail, broker=broker)


def clock_finding(c: redis.Redis, broker: str) -> Finding:
    t0 = time.time()
    sec, usec = c.time()
    t1 = time.time()
    skew = int(((t0 + t1) / 2 - (sec + usec / 1e6)) * 1000)
    if abs(skew) > MAX_SKEW_MS:
        return Finding("clock", Verdict.WARN, f"this host's clock is {skew:+,} ms off Redis's",
                       "run NTP (chrony) on every host: ledger and audit times come from the hosts", broker)
    return Finding("clock", Verdict.OK, f"this host is {skew:+,} ms off Redis's clock (leases use Redis's)",
                   broker=broker)


def worker_clocks(brokers: BrokerRegistry, settings: Settings) -> list[Finding]:
    """Each live worker's skew against Redis, as it measured it when it registered."""
    meta = brokers.meta
    from mqorder.rebalance.membership import ClientRegistry  # the admin side reads registrations

    clients, _, _ = ClientRegistry(meta, settings.heartbeat_timeout_ms).clients()
    out = []
    for c in clients:
        raw = meta.hget(keys.client_info(c.client_id), "skew_ms")
        if raw is None:
            continue
        skew = int(text(raw))
        if abs(skew) > MAX_SKEW_MS:
            out.append(Finding("clock", Verdict.WARN, f"worker {c.client_id}'s clock is {skew:+,} ms off Redis's",
                               "run NTP (chrony) on that host"))
    if clients and not out:
        out.append(Finding("clock", Verdict.OK, f"{len(clients)} live workers within {MAX_SKEW_MS} ms of Redis"))
    return out


def client_versions(brokers: BrokerRegistry, settings: Settings) -> list[Finding]:
    """Which mqorder (version and scripts) each live client runs: more than one is a rolling
    upgrade under way, or a worker left behind on the old one (RocketMQ's console lists each
    consumer's version)."""
    from mqorder.rebalance.membership import ClientRegistry

    clients, _, _ = ClientRegistry(brokers.meta, settings.heartbeat_timeout_ms).clients()
    by_version: dict[str, list[str]] = {}
    for c in clients:
        by_version.setdefault(c.version or "older than 0.1.0+scripts", []).append(c.client_id)
    if not by_version:
        return []
    if len(by_version) == 1:
        (version,) = by_version
        return [Finding("versions", Verdict.OK, f"{len(clients)} live clients run mqorder {version}")]
    shown = "; ".join(f"{v}: {', '.join(sorted(ids)[:5])}{' ...' if len(ids) > 5 else ''}"
                      for v, ids in sorted(by_version.items()))
    return [Finding("versions", Verdict.WARN, f"live clients run different mqorder versions ({shown})",
                    "finish the rolling upgrade (OPERATING.md \"Upgrading mqorder\"): a fix of the new version "
                    "applies only to the queues its workers hold")]


def celery_findings(settings: Settings, conf: Mapping[str, Any]) -> list[Finding]:
    out = []
    unsafe = {
        name: conf.get(name) for name in ("task_serializer", "result_serializer", "event_serializer")
        if conf.get(name) not in (None, "json")
    }
    accept = set(conf.get("accept_content") or ["json"])
    if unsafe or not accept <= {"json", "application/json"}:
        shown = ", ".join(f"{k}={v!r}" for k, v in unsafe.items())
        out.append(Finding("celery serializers", Verdict.FAIL,
                           f"not JSON only ({shown}{', ' if shown else ''}accept_content={sorted(accept)}): a worker "
                           "that accepts pickle runs code from whoever can write to the broker",
                           "task_serializer = result_serializer = 'json', accept_content = ['json']"))
    else:
        out.append(Finding("celery serializers", Verdict.OK, "JSON only"))
    url = str(conf.get("broker_url") or settings.effective_celery_broker_url)
    if is_cluster_url(url):
        out.append(Finding("celery broker", Verdict.FAIL, str(cluster_celery_broker_error(url, "Celery's broker")),
                           "set MQORDER_CELERY_BROKER_URL to redis://, redis+sentinel:// or amqp://"))
        return out
    # kombu's sentinel:// transport is its Redis transport behind Sentinel: the same visibility timeout.
    if url.startswith(("redis://", "rediss://", "unix://", "sentinel://", "redis+sentinel://", "rediss+sentinel://")):
        vt = float((conf.get("broker_transport_options") or {}).get("visibility_timeout", 3600))
        need = max(settings.run_lease_ms, settings.max_time_consume_continuously_ms) / 1000
        if vt <= need:
            out.append(Finding("celery visibility timeout", Verdict.FAIL,
                               f"visibility_timeout {vt:g} s is not longer than a ConsumeRequest may run "
                               f"({need:g} s, MQORDER_RUN_LEASE_MS / MAX_TIME_CONSUME_CONTINUOUSLY_MS): Redis hands a "
                               "running request out again", f"broker_transport_options visibility_timeout > {need:g}"))
        else:
            out.append(Finding("celery visibility timeout", Verdict.OK,
                               f"visibility_timeout {vt:g} s > {need:g} s a ConsumeRequest may run"))
    else:
        out.append(Finding("celery visibility timeout", Verdict.OK,
                           f"broker {url.split('://', 1)[0]}:// redelivers lost tasks itself (no visibility timeout)"))
    return out
