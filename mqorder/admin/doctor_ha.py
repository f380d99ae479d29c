"""``mqorder doctor`` on a replicated Redis: what a failover can lose, and whether one can happen.

Redis replication is asynchronous and Sentinel promotes whichever replica it can reach (by
priority, then by how much it has), so an operator needs the answer to one question per broker:
*with these settings, what does a failover lose?* The checks, and why:

* **role**: mqorder writes to the primary. Pointed at a replica, every send is refused
  (``READONLY``) and every figure below would describe the wrong node: FAIL, nothing else checked.
* **replicas**: how many are connected and how far each is behind: bytes (the primary's
  ``master_repl_offset`` minus the replica's acknowledged offset) and seconds since its last
  acknowledgement (``lag``). That gap is what a failover to that replica loses.
* **min-replicas**: ``min-replicas-to-write`` / ``min-replicas-max-lag`` (``CONFIG GET``; a renamed
  or refused ``CONFIG`` reads as "unknown"). At 0 an old primary cut off from its replicas and
  Sentinels keeps acknowledging writes; when it rejoins as a replica they are discarded.
* **failover**: the plain answer, from the replicas and ``MQORDER_SEND_WAIT_REPLICAS``: no
  replicas (a crash loses what was not fsynced; nothing to fail over to), or asynchronous replicas
  (a failover loses up to the promoted replica's lag of acknowledged sends that did not wait; lock
  grants are fenced by epoch whatever is lost, DESIGN invariant 9).
* **send durability**: ``MQORDER_SEND_WAIT_REPLICAS`` against the replicas connected: 0 means an
  acknowledged send can be lost on failover; more than are connected refuses every send.
* **sentinel** (a ``redis+sentinel://`` URL only): each Sentinel's view of the primary
  (``SENTINEL MASTER``: address, flags, quorum, other Sentinels, ``down-after-milliseconds``,
  ``failover-timeout``) and ``SENTINEL CKQUORUM``; then whether enough of them answer for a
  failover to be both agreed (``quorum``) and authorized (a majority of all Sentinels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mqorder.admin.findings import Finding, Verdict
from mqorder.settings import Settings
from mqorder.store.brokers import Broker
from mqorder.store.urls import SentinelURL, is_sentinel_url, parse_sentinel_url

#: Seconds since a replica's last acknowledgement past which it counts as behind (Redis's own
#: ``min-replicas-max-lag`` default is 10).
MAX_REPLICA_LAG_S = 10
#: Socket timeout of the doctor's connection to each Sentinel: a hung one costs this, not more.
SENTINEL_TIMEOUT_S = 1.0
#: The setting every durability finding names.
WAIT_SETTING = "MQORDER_SEND_WAIT_REPLICAS"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} B"
    if n < 1024 * 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / 1024 / 1024:,.1f} MiB"


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


# -- what the primary says ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaLag:
    """One replica as its primary sees it."""

    addr: str
    state: str
    #: Bytes of the replication stream the replica has not acknowledged.
    lag_bytes: int
    #: Seconds since its last acknowledgement (INFO's ``lag``).
    lag_s: int

    def to_json(self) -> dict[str, Any]:
        return {"addr": self.addr, "state": self.state, "lag_bytes": self.lag_bytes, "lag_s": self.lag_s}


@dataclass(frozen=True)
class Replication:
    """``INFO replication`` of one node, the parts the checks use."""

    role: str
    offset: int
    replicas: list[ReplicaLag] = field(default_factory=list)
    #: A replica's primary (``host:port``) and link status.
    primary: str = ""
    link: str = ""

    @property
    def is_primary(self) -> bool:
        return self.role == "master"

    @property
    def online(self) -> list[ReplicaLag]:
        return [r for r in self.replicas if r.state == "online"]


def read_replication(c: redis.Redis) -> Replication:
    info: Any = c.info("replication")
    role = str(info.get("role", "master"))
    if role != "master":
        return Replication(role, int(info.get("slave_repl_offset", 0) or 0),
                           primary=f"{info.get('master_host')}:{info.get('master_port')}",
                           link=str(info.get("master_link_status", "?")))
    offset = int(info.get("master_repl_offset", 0) or 0)
    replicas = []
    for i in range(int(info.get("connected_slaves", 0) or 0)):
        r = info.get(f"slave{i}")
        if not isinstance(r, dict):
            continue
        replicas.append(ReplicaLag(f"{r.get('ip')}:{r.get('port')}", str(r.get("state", "?")),
                                   max(0, offset - int(r.get("offset", 0) or 0)), int(r.get("lag", 0) or 0)))
    return Replication(role, offset, replicas)


@dataclass(frozen=True)
class MinReplicas:
    """``min-replicas-to-write`` and ``min-replicas-max-lag``; ``None`` with ``why`` when unknown."""

    to_write: int | None
    max_lag: int | None
    why: str = ""


def read_min_replicas(c: redis.Redis) -> MinReplicas:
    try:
        got: Any = c.config_get("min-replicas-*")
    except redis.ResponseError as exc:  # CONFIG renamed away (rename-command) or refused by ACL
        return MinReplicas(None, None, str(exc).splitlines()[0][:120])
    try:
        return MinReplicas(int(got["min-replicas-to-write"]), int(got["min-replicas-max-lag"]))
    except (KeyError, ValueError):
        return MinReplicas(None, None, f"CONFIG GET answered {got!r}")


# -- the findings -------------------------------------------------------------------------------------


def replication_findings(c: redis.Redis, settings: Settings, broker: str) -> list[Finding]:
    """Role, replicas, ``min-replicas-*``, what a failover loses, and the send durability setting."""
    rep = read_replication(c)
    if not rep.is_primary:
        return [Finding(
            "role", Verdict.FAIL,
            f"this is a replica (of {rep.primary}, link {rep.link}), not the primary: every send and commit is "
            "refused (READONLY), and the replication and failover checks would describe the wrong node",
            "point the URL at the primary, or better at the Sentinels: redis+sentinel://host:port,host:port/"
            "<master-name>, whose client follows the primary across failovers", broker,
            {"role": rep.role, "primary": rep.primary, "link": rep.link})]
    mins = read_min_replicas(c)
    return [
        Finding("role", Verdict.OK, "primary", broker=broker, data={"role": rep.role}),
        replicas_finding(rep, broker),
        min_replicas_finding(rep, mins, broker),
        failover_finding(rep, settings, broker),
        send_wait_finding(rep, settings, broker),
    ]


def replicas_finding(rep: Replication, broker: str) -> Finding:
    data = {"connected": len(rep.replicas), "online": len(rep.online), "master_repl_offset": rep.offset,
            "replicas": [r.to_json() for r in rep.replicas]}
    if not rep.replicas:
        return Finding("replicas", Verdict.WARN, "no replica is connected",
                       "add replicas (replicaof) and Sentinels to fail over to them", broker, data)
    each = "; ".join(f"{r.addr} {r.state}, {_size(r.lag_bytes)} behind, last ack {r.lag_s} s ago" for r in rep.replicas)
    detail = f"{_replicas(len(rep.replicas))} connected: {each}"
    behind = [r for r in rep.replicas if r.state != "online" or r.lag_s > MAX_REPLICA_LAG_S]
    if behind:
        return Finding("replicas", Verdict.WARN,
                       f"{detail}. Not online or silent over {MAX_REPLICA_LAG_S} s: "
                       f"{', '.join(r.addr for r in behind)}",
                       "check those replicas (their log, the network); a failover to one of them loses its lag",
                       broker, data)
    return Finding("replicas", Verdict.OK, detail, broker=broker, data=data)


def min_replicas_finding(rep: Replication, mins: MinReplicas, broker: str) -> Finding:
    data = {"min_replicas_to_write": mins.to_write, "min_replicas_max_lag": mins.max_lag}
    if mins.to_write is None:
        return Finding("min-replicas", Verdict.WARN,
                       f"min-replicas-to-write and min-replicas-max-lag are unknown (CONFIG GET: {mins.why})",
                       "read them in redis.conf: min-replicas-to-write 1 and min-replicas-max-lag 10 keep an "
                       "isolated old primary from accepting writes it will discard", broker, data)
    shown = f"min-replicas-to-write {mins.to_write}, min-replicas-max-lag {mins.max_lag}"
    if mins.to_write == 0:
        if not rep.replicas:
            return Finding("min-replicas", Verdict.OK, f"{shown} (no replicas: nothing to fail over to)",
                           broker=broker, data=data)
        return Finding("min-replicas", Verdict.WARN,
                       f"{shown}: an isolated old primary keeps accepting writes that are discarded when it rejoins "
                       "as a replica of the promoted one",
                       "CONFIG SET min-replicas-to-write 1 and min-replicas-max-lag 10 (and in redis.conf): cut off "
                       "from its replicas, a primary then refuses writes (sends fail with NOREPLICAS, "
                       "BrokerRefusedError: nothing stored) instead of acknowledging writes it will lose", broker, data)
    good = [r for r in rep.online if r.lag_s <= (mins.max_lag or 0)]
    if len(good) < mins.to_write:
        return Finding("min-replicas", Verdict.FAIL,
                       f"{shown}, but only {len(good)} replica(s) acknowledged within {mins.max_lag} s: the primary "
                       "refuses every write now (NOREPLICAS)",
                       "bring the replicas back, or lower min-replicas-to-write", broker, data)
    return Finding("min-replicas", Verdict.OK,
                   f"{shown}: cut off from its replicas, a primary refuses writes after {mins.max_lag} s instead of "
                   "acknowledging writes a failover discards", broker=broker, data=data)


def failover_finding(rep: Replication, settings: Settings, broker: str) -> Finding:
    """The plain sentence: what a failover (or a crash) loses with these replicas and settings."""
    wait = settings.send_wait_replicas
    if not rep.replicas:
        return Finding("failover", Verdict.WARN,
                       "no replicas: a primary crash loses everything since the last fsync/RDB; no failover possible",
                       "add replicas and Sentinels (store URL redis+sentinel://...), and AOF on every node",
                       broker, {"replicas": 0})
    worst_b = max(r.lag_bytes for r in rep.replicas)
    worst_s = max(r.lag_s for r in rep.replicas)
    data = {"replicas": len(rep.replicas), "max_lag_bytes": worst_b, "max_lag_s": worst_s, "send_wait_replicas": wait}
    lost = (f"{_replicas(len(rep.replicas))}, async: a failover can lose up to {_size(worst_b)} (last ack up to "
            f"{worst_s} s ago) of acknowledged writes")
    if wait == 0:
        return Finding("failover", Verdict.WARN,
                       f"{lost}: every send (none waits: {WAIT_SETTING}=0), and consume progress, which is "
                       "redelivered, never reordered; lock grants are re-fenced by epoch",
                       f"set {WAIT_SETTING}=1 (or wait_replicas=1 on the sends that must survive)", broker, data)
    return Finding("failover", Verdict.OK,
                   f"{lost}, but not sends: they wait for {_replicas(wait)} ({WAIT_SETTING}={wait}), so an "
                   "acknowledged send survives a failover to a replica that has it; lost consume progress is "
                   "redelivered, never reordered; lock grants are re-fenced by epoch", broker=broker, data=data)


def send_wait_finding(rep: Replication, settings: Settings, broker: str) -> Finding:
    wait, connected = settings.send_wait_replicas, len(rep.replicas)
    data = {"send_wait_replicas": wait, "send_wait_timeout_ms": settings.send_wait_timeout_ms,
            "connected_slaves": connected}
    if wait > connected:
        return Finding("send durability", Verdict.FAIL,
                       f"{WAIT_SETTING}={wait} but the primary has connected_slaves:{connected}: every send is "
                       "refused (NotEnoughReplicasError) before anything is stored",
                       f"bring the replicas back, or lower {WAIT_SETTING} to at most {connected}", broker, data)
    if wait == 0:
        if not connected:
            return Finding("send durability", Verdict.OK,
                           f"{WAIT_SETTING}=0: sends do not wait for replicas (there are none)", broker=broker,
                           data=data)
        return Finding("send durability", Verdict.WARN,
                       f"{WAIT_SETTING}=0: acknowledged sends can be lost on failover (replication is async; "
                       "a send is acknowledged before any replica has it)",
                       f"set {WAIT_SETTING}=1: each send then waits (WAIT, in its own round trip) until a replica "
                       "has it, and raises ReplicasBehindError if none does in MQORDER_SEND_WAIT_TIMEOUT_MS", broker,
                       data)
    return Finding("send durability", Verdict.OK,
                   f"{WAIT_SETTING}={wait}: a send is acknowledged once {_replicas(wait)} of {connected} have it "
                   f"(up to {settings.send_wait_timeout_ms} ms, else ReplicasBehindError)", broker=broker, data=data)


# -- Sentinel -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SentinelView:
    """What one Sentinel says about the monitored primary; ``error`` if it could not say."""

    addr: str
    error: str = ""
    primary: str = ""
    flags: str = ""
    quorum: int = 0
    other_sentinels: int = 0
    down_after_ms: int = 0
    failover_timeout_ms: int = 0
    replicas: int = 0
    ckquorum: str = ""
    ckquorum_ok: bool = False
    #: The Sentinel answered at all (an ``error`` may still be its answer, e.g. an unknown master).
    reachable: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"addr": self.addr, "reachable": self.reachable, "error": self.error, "primary": self.primary,
                "flags": self.flags, "quorum": self.quorum, "num_other_sentinels": self.other_sentinels,
                "down_after_ms": self.down_after_ms, "failover_timeout_ms": self.failover_timeout_ms,
                "num_replicas": self.replicas, "ckquorum": self.ckquorum, "ckquorum_ok": self.ckquorum_ok}


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _fields(raw: Any) -> dict[str, str]:
    """``SENTINEL MASTER``'s reply as text fields, whether redis-py made it a dict or not."""
    if isinstance(raw, dict):
        return {_text(k): _text(v) for k, v in raw.items()}
    items = [_text(x) for x in raw]
    return dict(zip(items[::2], items[1::2], strict=False))


def ask_sentinel(parsed: SentinelURL, host: str, port: int) -> SentinelView:
    addr = f"{host}:{port}"
    # One attempt: redis-py's default retries with backoff would make a dead Sentinel cost seconds.
    c = redis.Redis(host=host, port=port, username=parsed.sentinel_username, password=parsed.sentinel_password,
                    socket_timeout=SENTINEL_TIMEOUT_S, socket_connect_timeout=SENTINEL_TIMEOUT_S,
                    retry=Retry(NoBackoff(), 0))
    try:
        try:
            f = _fields(c.execute_command("SENTINEL", "MASTER", parsed.master_name))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            return SentinelView(addr, f"did not answer ({type(exc).__name__}: {exc})", reachable=False)
        except redis.ResponseError as exc:
            return SentinelView(addr, str(exc))
        try:
            ck = c.execute_command("SENTINEL", "CKQUORUM", parsed.master_name)
            ck_text, ck_ok = _text(ck), True
        except redis.ResponseError as exc:
            ck_text, ck_ok = str(exc), False
        return SentinelView(
            addr, primary=f"{f.get('ip')}:{f.get('port')}", flags=f.get("flags", ""),
            quorum=int(f.get("quorum", 0)), other_sentinels=int(f.get("num-other-sentinels", 0)),
            down_after_ms=int(f.get("down-after-milliseconds", 0)), failover_timeout_ms=int(f.get("failover-timeout", 0)),
            replicas=int(f.get("num-slaves", 0)), ckquorum=ck_text, ckquorum_ok=ck_ok)
    except redis.RedisError as exc:  # AUTH refused and the like: an answer, but not the view
        return SentinelView(addr, f"{type(exc).__name__}: {exc}")
    finally:
        c.close()


def sentinel_findings(broker: Broker) -> list[Finding]:
    """One finding per Sentinel of a ``redis+sentinel://`` broker, then whether a failover can
    happen with those that answer; nothing for a plain URL."""
    if not is_sentinel_url(broker.url):
        return []
    parsed = parse_sentinel_url(broker.url)
    views = [ask_sentinel(parsed, h, p) for h, p in parsed.sentinels]
    return [*(_one_sentinel(v, parsed.master_name, broker.name) for v in views),
            _sentinels_summary(views, parsed, broker.name)]


def _one_sentinel(v: SentinelView, master: str, broker: str) -> Finding:
    data = v.to_json()
    if not v.reachable:
        return Finding("sentinel", Verdict.WARN, f"{v.addr} {v.error}: it takes no part in noticing a failure or "
                       "electing the Sentinel that fails over", "start that Sentinel again, or take it out of the URL",
                       broker, data)
    if v.error:
        return Finding("sentinel", Verdict.FAIL, f"{v.addr} answered but not about {master!r}: {v.error}",
                       f"check that it monitors {master!r} (sentinel monitor {master} <host> <port> <quorum>) and "
                       "the Sentinel password (sentinel_password= in the URL, or MQORDER_SENTINEL_PASSWORD)",
                       broker, data)
    seen = (f"{v.addr} sees primary {v.primary} ({v.flags}), {v.replicas} replica(s), quorum {v.quorum}, "
            f"{v.other_sentinels} other Sentinel(s), down-after {v.down_after_ms:,} ms, failover-timeout "
            f"{v.failover_timeout_ms:,} ms; CKQUORUM: {v.ckquorum}")
    if "s_down" in v.flags or "o_down" in v.flags:
        return Finding("sentinel", Verdict.FAIL, f"{seen}: it considers the primary down",
                       "a failover is due or under way: check the primary and `SENTINEL MASTER` again", broker, data)
    if not v.ckquorum_ok:
        return Finding("sentinel", Verdict.FAIL, seen,
                       "start the missing Sentinels (or replace them): without a quorum and a majority no failover "
                       "can happen", broker, data)
    return Finding("sentinel", Verdict.OK, seen, broker=broker, data=data)


def _sentinels_summary(views: list[SentinelView], parsed: SentinelURL, broker: str) -> Finding:
    """Whether a failover can happen now: ``quorum`` Sentinels must agree the primary is down, and a
    majority of every Sentinel they know of must elect the one that fails over."""
    good = [v for v in views if v.reachable and not v.error]
    known = max([len(views), *(v.other_sentinels + 1 for v in good)])
    majority = known // 2 + 1
    quorum = max((v.quorum for v in good), default=0)
    primaries = sorted({v.primary for v in good})
    data = {"listed": len(views), "answering": len(good), "known": known, "quorum": quorum, "majority": majority,
            "primaries": primaries}
    if not good:
        if any(v.reachable for v in views):
            # They answer, about another name: the URL's master name (or their monitor) is wrong, and
            # "start the Sentinels" sent the reader to Sentinels that were running.
            return Finding("sentinels", Verdict.FAIL,
                           f"{sum(v.reachable for v in views)} of the {len(views)} Sentinels answered, but none knows "
                           f"a primary named {parsed.master_name!r}: clients cannot find the primary",
                           f"fix the master name in the URL (redis+sentinel://hosts/<name>: `SENTINEL MASTERS` on a "
                           f"Sentinel lists the names it monitors), or have the Sentinels monitor {parsed.master_name!r}",
                           broker, data)
        return Finding("sentinels", Verdict.FAIL,
                       f"none of the {len(views)} Sentinels of {parsed.master_name!r} answered: clients cannot find "
                       "the primary, and no failover can happen",
                       "start the Sentinels, or fix the hosts in the URL", broker, data)
    need = max(quorum, majority)
    counted = (f"{len(good)} of {known} Sentinels answer (a failover needs quorum {quorum} to agree the primary is "
               f"down and a majority, {majority}, to authorize it)")
    if len(good) < need:
        return Finding("sentinels", Verdict.FAIL, f"{counted}: no failover can happen now",
                       "start the Sentinels that do not answer (see above)", broker, data)
    if len(primaries) > 1:
        return Finding("sentinels", Verdict.WARN, f"{counted}, but they name different primaries: {', '.join(primaries)}",
                       "wait for the Sentinels to converge (a failover just happened?), or check their configuration",
                       broker, data)
    missing = len(views) - len(good)
    tail = f"; {missing} listed in the URL do not answer (see above)" if missing else ""
    return Finding("sentinels", Verdict.OK, f"{counted}: a failover can happen; primary {primaries[0]}{tail}",
                   broker=broker, data=data)
