"""``mqorder doctor`` on a Redis Cluster (a ``redis+cluster://`` store URL): can every queue be served?

On a cluster a queue lives in one hash slot, on the primary serving that slot. So the questions
are per slot and per primary, and the checks, and why:

* **cluster state**: ``CLUSTER INFO``'s ``cluster_state`` on every node. A node in ``fail`` refuses
  every command (``CLUSTERDOWN``), so a client that reaches it stalls whatever its key.
* **slot coverage**: all 16,384 slots assigned to a primary (``CLUSTER NODES``: the slot ranges
  with each node's flags), and each primary serving them up. A slot with no live primary stops
  every queue hashed there, while the other queues carry on (``cluster-require-full-coverage no``)
  or the whole cluster stops (``yes``): either way those queues' sends and consumption wait.
* **replicas**: a primary with no live replica is a single point of failure for its slots: when it
  dies nothing is promoted, its queues stop until it returns, and what it had not persisted is
  lost. The cluster fails over by itself only to a replica.
* **nodes**: nodes the cluster marks ``fail`` (agreed down) or ``fail?`` (one node's suspicion),
  and nodes that do not answer this host (a client here could not reach them either).
* **version**: on a cluster mqorder's wake-ups use sharded pub/sub (``SPUBLISH``/``SSUBSCRIBE``,
  delivered on the node serving the channel's slot instead of broadcast to every node), which
  needs Redis 7.0 on every node.
* **queue slots**: every key of one queue (its log, offset counter, each subscription's state...)
  must be in one slot, or its Lua scripts fail with ``CROSSSLOT`` and lose their atomicity. They
  share the queue's hash tag (``mqorder.keys.queue_tag``), so this is a check of the key schema
  against the topics that exist: it names the queue whose keys would split.

``CLUSTER NODES`` rather than ``CLUSTER SLOTS``/``SHARDS``: it is the one reply that has the slot
ranges, the replica-to-primary links and the ``fail``/``fail?`` flags together (``SLOTS`` shows a
failed primary as serving; ``SHARDS`` has no ``fail?``), on every Redis version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from mqorder import keys
from mqorder.admin.findings import Finding, Verdict
from mqorder.store.cluster_urls import ClusterURL, host_port, parse_cluster_url
from mqorder.store.replies import text

#: Hash slots of a Redis Cluster.
SLOTS = 16384
#: Sharded pub/sub (SPUBLISH/SSUBSCRIBE), which mqorder's wake-ups use on a cluster.
SHARDED_PUBSUB_VERSION = (7, 0)
#: Socket timeout of the doctor's connection to each node: a hung node costs this, not more.
NODE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ClusterNodeEntry:
    """One line of ``CLUSTER NODES``: a node as the cluster sees it."""

    node_id: str
    addr: str
    flags: frozenset[str]
    #: The primary's id of a replica; ``None`` for a primary.
    primary_id: str | None
    #: Inclusive slot ranges a primary serves.
    slots: tuple[tuple[int, int], ...] = ()

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        """Agreed down by a majority of primaries."""
        return "fail" in self.flags

    @property
    def suspected(self) -> bool:
        """Suspected down by the node that answered (``fail?``), not yet agreed."""
        return "fail?" in self.flags

    @property
    def slot_count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.slots)

    @property
    def slot_text(self) -> str:
        return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in self.slots) or "none"


def parse_cluster_nodes(raw: str) -> list[ClusterNodeEntry]:
    """``CLUSTER NODES``' text: ``<id> <ip:port@cport[,hostname]> <flags> <primary|-> <ping> <pong>
    <epoch> <link> <slot>...``; a slot is ``n`` or ``a-b``, ``[...]`` is a migration (skipped)."""
    out = []
    for line in raw.strip().splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        hostport = parts[1].split("@", 1)[0]
        host, _, port = hostport.rpartition(":")
        slots = []
        for item in parts[8:]:
            if item.startswith("["):
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        out.append(ClusterNodeEntry(parts[0], host_port(host, int(port or 0)), frozenset(parts[2].split(",")),
                                    None if parts[3] == "-" else parts[3], tuple(slots)))
    return out


@dataclass
class NodeAnswer:
    """What one node told the doctor; ``error`` if it did not answer."""

    addr: str
    cluster_state: str = ""
    version: str = ""
    error: str = ""


@dataclass
class ClusterProbe:
    """The cluster as seen from here: its nodes (one live node's ``CLUSTER NODES``) and each node's
    own answers. ``error`` when no listed node gave a slot map at all."""

    url: ClusterURL
    nodes: list[ClusterNodeEntry] = field(default_factory=list)
    answers: dict[str, NodeAnswer] = field(default_factory=dict)
    #: The node whose ``CLUSTER NODES`` is ``nodes``.
    seen_from: str = ""
    error: str = ""
    cluster: RedisCluster | None = None
    _clients: dict[str, redis.Redis] = field(default_factory=dict)

    def client(self, addr: str) -> redis.Redis:
        """A plain client of one node: one attempt, short timeouts (a dead node costs a second)."""
        if addr not in self._clients:
            host, _, port = addr.rpartition(":")
            self._clients[addr] = redis.Redis(
                host=host.strip("[]"), port=int(port), username=self.url.username, password=self.url.password,
                ssl=self.url.ssl, socket_timeout=NODE_TIMEOUT_S, socket_connect_timeout=NODE_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0))
        return self._clients[addr]

    @property
    def primaries(self) -> list[ClusterNodeEntry]:
        """Primaries that serve slots (an empty primary holds no queue)."""
        return [n for n in self.nodes if n.is_primary and n.slots]

    def replicas_of(self, primary: ClusterNodeEntry) -> list[ClusterNodeEntry]:
        return [n for n in self.nodes if n.primary_id == primary.node_id]

    def live_primaries(self) -> list[tuple[str, redis.Redis]]:
        """``(addr, client)`` of every slot-serving primary that answered: for the per-node checks
        (persistence, eviction, memory) that ``mqorder.admin.doctor`` runs on one Redis."""
        return [(n.addr, self.client(n.addr)) for n in self.primaries if not self.answers[n.addr].error]

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        if self.cluster is not None:
            self.cluster.close()


def probe_cluster(url: str) -> ClusterProbe:
    """Read the cluster a ``redis+cluster://`` URL names, asking each of its nodes in turn."""
    parsed = parse_cluster_url(url)
    probe = ClusterProbe(parsed)
    try:
        probe.cluster = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in parsed.startup_nodes], username=parsed.username,
            password=parsed.password, ssl=parsed.ssl, require_full_coverage=False,
            socket_timeout=NODE_TIMEOUT_S, socket_connect_timeout=NODE_TIMEOUT_S, retry=Retry(NoBackoff(), 1))
    except (RedisClusterException, redis.RedisError) as exc:
        probe.error = str(exc).splitlines()[0][:300]
        return probe
    # The slot map lists every primary and replica a client will use; each is asked for its own
    # CLUSTER NODES until one answers (the listed nodes first: they are the ones the user chose).
    candidates = [host_port(h, p) for h, p in parsed.startup_nodes]
    candidates += [host_port(n.host, n.port) for n in probe.cluster.get_nodes()
                   if host_port(n.host, n.port) not in candidates]
    for addr in candidates:
        try:
            probe.nodes = parse_cluster_nodes(text(probe.client(addr).execute_command("CLUSTER", "NODES")))
            probe.seen_from = addr
            break
        except redis.RedisError:
            continue
    for n in probe.nodes:
        probe.answers[n.addr] = _ask(probe.client(n.addr), n.addr)
    return probe


def _ask(c: redis.Redis, addr: str) -> NodeAnswer:
    try:
        info = text(c.execute_command("CLUSTER", "INFO"))
        state = dict(line.split(":", 1) for line in info.splitlines() if ":" in line).get("cluster_state", "?")
        return NodeAnswer(addr, state.strip(), str(c.info("server").get("redis_version", "0")))
    except redis.RedisError as exc:
        return NodeAnswer(addr, error=f"did not answer ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")


# -- the findings -------------------------------------------------------------------------------------


def cluster_findings(probe: ClusterProbe, broker: str, routes: Any = None) -> list[Finding]:
    """Every cluster check of a probed cluster. ``routes`` is the Redis holding the topic routes
    (the default broker), ``None`` when it is this cluster."""
    if probe.error or not probe.nodes:
        return [unreachable_finding(probe, broker)]
    return [
        state_finding(probe, broker),
        coverage_finding(probe, broker),
        *replica_findings(probe, broker),
        *node_findings(probe, broker),
        *version_findings(probe, broker),
        queue_slots_finding(probe, broker, routes if routes is not None else probe.cluster),
    ]


def unreachable_finding(probe: ClusterProbe, broker: str) -> Finding:
    listed = ", ".join(host_port(h, p) for h, p in probe.url.startup_nodes)
    why = probe.error or "no node answered CLUSTER NODES"
    if "cluster mode is not enabled" in why.lower() or "cluster support disabled" in why.lower():
        return Finding("cluster", Verdict.FAIL, f"{listed}: not a Redis Cluster ({why})",
                       "for a single Redis write the URL as redis://host:port/0; for a cluster, list its nodes",
                       broker)
    return Finding("cluster", Verdict.FAIL, f"no node of {listed} gave the cluster's slot map: {why}",
                   "start the cluster's nodes, or list nodes that are up in the URL (any one is enough)", broker)


def state_finding(probe: ClusterProbe, broker: str) -> Finding:
    answered = [a for a in probe.answers.values() if not a.error]
    down = [a.addr for a in answered if a.cluster_state != "ok"]
    data = {a.addr: a.cluster_state for a in answered}
    if down:
        return Finding("cluster state", Verdict.FAIL,
                       f"cluster_state fail on {', '.join(down)}: those nodes refuse every command (CLUSTERDOWN)",
                       "bring back the primaries of unserved slots (see slot coverage) or assign their slots: "
                       "`redis-cli --cluster fix <host:port>`", broker, data)
    return Finding("cluster state", Verdict.OK, f"cluster_state ok on the {len(answered)} nodes that answered",
                   broker=broker, data=data)


def _unserved(probe: ClusterProbe, n: ClusterNodeEntry) -> str:
    """Why primary ``n`` does not serve its slots now, or ``""``."""
    if n.failed:
        return "marked fail by the cluster"
    if probe.answers[n.addr].error:
        return probe.answers[n.addr].error
    if n.suspected:
        return "suspected down (fail?)"
    return ""


def coverage_finding(probe: ClusterProbe, broker: str) -> Finding:
    assigned = sum(n.slot_count for n in probe.primaries)
    bad = [(n, why) for n in probe.primaries if (why := _unserved(probe, n))]
    lost = sum(n.slot_count for n, _ in bad)
    data = {"assigned": assigned, "unserved": lost, "primaries": len(probe.primaries),
            "unserved_by": {n.addr: n.slot_text for n, _ in bad}}
    if bad:
        each = "; ".join(f"{n.addr} (slots {n.slot_text}) {why}" for n, why in bad)
        return Finding("slot coverage", Verdict.FAIL,
                       f"{lost:,} of {SLOTS:,} slots have no live primary: {each}. The queues hashed there "
                       "accept no send and make no progress",
                       "restart that node (its queues resume where they were), or add a replica so the cluster "
                       "fails over by itself next time", broker, data)
    if assigned < SLOTS:
        return Finding("slot coverage", Verdict.FAIL,
                       f"{SLOTS - assigned:,} of {SLOTS:,} slots are assigned to no primary: a queue hashed "
                       "there cannot be written", "`redis-cli --cluster fix <host:port>` assigns them", broker, data)
    return Finding("slot coverage", Verdict.OK,
                   f"all {SLOTS:,} slots assigned to {len(probe.primaries)} primaries, each up", broker=broker,
                   data=data)


def replica_findings(probe: ClusterProbe, broker: str) -> list[Finding]:
    """A WARN per primary with no live replica, else one OK."""
    counts = {n.addr: len([r for r in probe.replicas_of(n) if not r.failed and not probe.answers[r.addr].error])
              for n in probe.primaries}
    out = []
    for n in probe.primaries:
        if counts[n.addr]:
            continue
        out.append(Finding(
            "replicas", Verdict.WARN,
            f"primary {n.addr} (slots {n.slot_text}) has no live replica: if it fails, its {n.slot_count:,} slots "
            "(the queues hashed there) are unavailable until it returns, and what it had not persisted is lost",
            f"add a replica: start a redis-server with cluster-enabled yes, then `redis-cli --cluster add-node "
            f"<new-host:port> {n.addr} --cluster-slave --cluster-master-id {n.node_id}`", broker,
            {"primary": n.addr, "replicas": 0}))
    if not out:
        shown = ", ".join(f"{a}: {c}" for a, c in counts.items())
        out.append(Finding("replicas", Verdict.OK,
                           f"every primary has a live replica to fail over to ({shown})", broker=broker, data=counts))
    return out


def node_findings(probe: ClusterProbe, broker: str) -> list[Finding]:
    """A finding per node marked fail/fail? or not answering; one OK when there is none."""
    out = []
    for n in probe.nodes:
        role = "primary" if n.is_primary else "replica"
        if n.failed:
            why = "marked fail by the cluster"
        elif n.suspected:
            why = f"suspected down (fail?) by {probe.seen_from}"
        else:
            why = probe.answers[n.addr].error
        if not why:
            continue
        serving = n.is_primary and bool(n.slots)
        out.append(Finding(
            "cluster nodes", Verdict.FAIL if serving and not n.suspected else Verdict.WARN,
            f"{role} {n.addr} ({n.node_id[:8]}): {why}",
            "restart it; a replica left behind resyncs by itself, a primary that was failed over rejoins as a "
            "replica of its successor", broker, {"node": n.addr, "id": n.node_id, "flags": sorted(n.flags)}))
    if not out:
        roles = sum(n.is_primary for n in probe.nodes)
        out.append(Finding("cluster nodes", Verdict.OK,
                           f"{len(probe.nodes)} nodes ({roles} primaries, {len(probe.nodes) - roles} replicas), none "
                           "marked fail or fail?, all answering", broker=broker))
    return out


def _version(version: str) -> tuple[int, ...]:
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2])


def version_findings(probe: ClusterProbe, broker: str) -> list[Finding]:
    answered = [a for a in probe.answers.values() if not a.error]
    old = [a for a in answered if _version(a.version) < SHARDED_PUBSUB_VERSION]
    out = [Finding("cluster version", Verdict.FAIL,
                   f"Redis {a.version} on {a.addr}: mqorder's wake-ups on a cluster use sharded pub/sub "
                   "(SPUBLISH/SSUBSCRIBE), which needs Redis 7.0", "upgrade every node to Redis 7.x", broker,
                   {"node": a.addr, "version": a.version}) for a in old]
    if not out:
        versions = sorted({a.version for a in answered})
        out.append(Finding("cluster version", Verdict.OK,
                           f"Redis {', '.join(versions)} on the {len(answered)} nodes that answered: sharded pub/sub "
                           "(SPUBLISH/SSUBSCRIBE) for wake-ups", broker=broker, data={"versions": versions}))
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def queue_keys(tag: str, subs: Iterable[str]) -> list[str]:
    """Every key of one queue whose slot must be the queue's: the keys a queue's scripts touch together."""
    per_queue = [keys.queue_log(tag), keys.queue_next(tag), keys.queue_ids(tag), keys.queue_dedup(tag),
                 keys.queue_dedup_expiry(tag), keys.txn_index(tag), keys.txn_half(tag), keys.txn_log(tag),
                 keys.delay_schedule(tag), keys.delay_messages(tag), keys.delay_seq(tag)]
    for sub in subs:
        per_queue += [keys.sub_state(tag, sub), keys.sub_retries(tag, sub)]
    return per_queue


def split_queue(tag: str, subs: Iterable[str]) -> dict[int, list[str]] | None:
    """The queue's keys by slot when they are in more than one slot, else ``None``."""
    by_slot: dict[int, list[str]] = {}
    for k in queue_keys(tag, subs):
        by_slot.setdefault(key_slot(k.encode()), []).append(k)
    return by_slot if len(by_slot) > 1 else None


def queue_slots_finding(probe: ClusterProbe, broker: str, routes: Any) -> Finding:
    """Every queue of this broker (from the topic routes) has all its keys in one slot."""
    try:
        topics = sorted(text(t) for t in routes.smembers(keys.topics()))
        layouts = {t: json.loads(text(routes.hget(keys.topic_route(t), "layout") or b"{}")) for t in topics}
        subs = {t: sorted(text(s) for s in routes.smembers(keys.topic_subs(t))) for t in topics}
    except (redis.RedisError, RedisClusterException, ValueError) as exc:
        return Finding("queue slots", Verdict.WARN, f"the topic routes could not be read: {exc}",
                       "run doctor again once every slot is served (see slot coverage)", broker)
    owner = {slot: n.addr for n in probe.primaries for lo, hi in n.slots for slot in range(lo, hi + 1)}
    checked = 0
    per_node: dict[str, int] = {}
    for topic in topics:
        for qid in range(int(layouts[topic].get(broker, 0))):
            tag = keys.queue_tag(topic, broker, qid)
            split = split_queue(tag, subs[topic])
            if split:
                shown = "; ".join(f"slot {s}: {', '.join(ks)}" for s, ks in sorted(split.items()))
                return Finding("queue slots", Verdict.FAIL,
                               f"queue {keys.queue_key(topic, broker, qid)}'s keys are in {len(split)} slots ({shown}): "
                               "its scripts fail with CROSSSLOT", "every per-queue key must carry the queue's hash "
                               "tag (mqorder.keys.queue_tag): fix the key schema", broker,
                               {"queue": keys.queue_key(topic, broker, qid), "slots": sorted(split)})
            checked += 1
            node = owner.get(key_slot(tag.encode()), "unassigned")
            per_node[node] = per_node.get(node, 0) + 1
    spread = ", ".join(f"{a}: {c}" for a, c in sorted(per_node.items()))
    return Finding("queue slots", Verdict.OK,
                   f"{_count(checked, 'queue')} of {_count(len(topics), 'topic')} checked: each queue's keys "
                   "share one slot"
                   + (f"; queues per primary: {spread}" if spread else ""),
                   broker=broker, data={"queues": checked, "topics": len(topics), "queues_per_primary": per_node})
