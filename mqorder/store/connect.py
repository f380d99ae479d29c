"""One way to turn a store URL into a Redis client: ``connect(url)``.

A plain URL (``redis://``, ``rediss://``, ``unix://``) is ``redis.Redis.from_url``. A Sentinel
URL (``redis+sentinel://``, ``mqorder.store.urls``) is a ``redis.sentinel.Sentinel`` over the
listed Sentinels and ``master_for(<master-name>)``: a client whose pool is redis-py's
``SentinelConnectionPool``. Every new connection of that pool asks the Sentinels where the
primary is now, so after a failover the *same* client object (and everything holding it: a
``Broker``, its ``Scripts``, a ``ConnectionLease``, a pub/sub) reaches the promoted replica by
itself:

* a connection to the dead primary fails (``ConnectionError``); mqorder's retry loops (a
  ConsumeRequest's Redis retry budget, a client's duties, its wake-up subscription) drop it and
  try again, and the new connection goes wherever the Sentinels point;
* a connection to an old primary that came back demoted answers writes with ``READONLY``, which
  redis-py turns into a ``ConnectionError`` and a disconnect: the same path;
* scripts are loaded per Redis and the promoted replica may not have them: ``EVALSHA`` gets
  ``NOSCRIPT`` and ``Scripts`` loads them again (as after a restart).

Sentinel's own connections (a few tiny queries per new data connection) get a short timeout,
``SENTINEL_TIMEOUT_S`` at most, so one hung Sentinel costs a second, not a socket timeout, before
the next one is asked.
"""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.store.cluster_route import ClusterClient
from mqorder.store.cluster_urls import ClusterURL, is_cluster_url, parse_cluster_url, redact_cluster_url
from mqorder.store.urls import SentinelURL, host_port, is_sentinel_url, parse_sentinel_url

#: Upper bound of the socket (and connect) timeout of a connection to a Sentinel, in seconds.
SENTINEL_TIMEOUT_S = 1.0

#: Client keywords that configure the connections to the data nodes and not the pool itself, and
#: that a Sentinel URL may set (its query wins over the caller's, as a plain URL's does in from_url).
_URL_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


class SentinelAuthError(MasterNotFoundError):
    """A Sentinel refused our credentials (its ``requirepass``), so no primary can be found.

    A subclass of redis-py's ``MasterNotFoundError`` (a ``ConnectionError``): every retry loop and
    error report that handles an unreachable Redis handles it too, with a message that says what
    to fix instead of "No master found".
    """


#: Error replies that mean "this node is no longer a primary you may use": Redis 7 answers
#: NOREPLICAS to a write on a primary that has fewer than ``min-replicas-to-write`` good replicas,
#: which is what an old primary resumed after a failover (SIGSTOP, a partition) says until Sentinel
#: demotes it (READONLY after that, which redis-py already handles).
DEMOTED_REPLIES = ("NOREPLICAS",)


class DemotionAware:
    """A Sentinel-managed connection that treats a NOREPLICAS reply like redis-py treats READONLY:
    it drops the connection (the next one asks the Sentinels for the primary again) and raises
    ``ConnectionError``, which every retry loop (the engine's, kombu's) knows to retry. Left a
    ``ResponseError``, it would be retried on the same connection to the same old primary until
    Sentinel demotes it (seconds), and kombu takes it for an unrecoverable error: a Celery worker
    whose broker connection got NOREPLICAS on its BRPOP exited (chaos ``sentinel-pause``)."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if str(exc).startswith(DEMOTED_REPLIES):
                self.disconnect()  # type: ignore[attr-defined]
                raise redis.ConnectionError(
                    f"the primary refused a write ({str(exc).split('.')[0]}): it has lost its replicas, "
                    "most likely it is an old primary that Sentinel has replaced; asking the Sentinels again"
                ) from exc
            raise


class DemotionAwareConnection(DemotionAware, SentinelManagedConnection):
    """``SentinelManagedConnection`` that also takes NOREPLICAS for a demoted primary."""


class DemotionAwareSSLConnection(DemotionAware, SentinelManagedSSLConnection):
    """The TLS variant (``rediss+sentinel://``)."""


class MqorderSentinel(Sentinel):
    """redis-py's ``Sentinel``, whose failure to find a primary says *why*: which Sentinels were
    asked and what each answered (redis-py says "No master found", with the repr of a client per
    Sentinel that did not answer), and what to do about it."""

    def __init__(self, parsed: SentinelURL, sentinels: list[tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(sentinels, **kwargs)
        self.parsed = parsed

    def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            return super().discover_master(service_name)
        except MasterNotFoundError as exc:
            raise self._not_found(service_name) from exc

    def _not_found(self, service_name: str) -> MasterNotFoundError:
        """Why no Sentinel named a primary for ``service_name``: each is asked again (one ``SENTINEL
        MASTERS``, with the Sentinels' short timeout), only after a failure, where redis-py's error
        has lost the details. ``SentinelAuthError`` if any refused our credentials (the fix is the
        same whatever the others said), else a ``MasterNotFoundError`` (a ``ConnectionError``:
        every retry loop treats it as before) naming every Sentinel and what to check."""
        refused: list[str] = []
        asked: list[str] = []
        seen: set[str] = set()
        for s in self.sentinels:
            kw = s.connection_pool.connection_kwargs
            addr = host_port(str(kw.get("host")), int(kw.get("port") or 0))
            try:
                raw = s.sentinel_masters()
            except redis.AuthenticationError as exc:
                refused.append(f"{addr}: {exc}")
                continue
            except redis.RedisError as exc:
                asked.append(f"{addr} (no answer: {str(exc).rstrip('.')})")
                seen.add("down")
                continue
            # By name (redis-py's RESP2 parsing); a list of states in its newer reply shape.
            masters = raw if isinstance(raw, dict) else {str(m.get("name")): m for m in raw}
            state = masters.get(service_name)
            if state is None:
                names = ", ".join(repr(str(n)) for n in sorted(masters)) or "no name at all"
                asked.append(f"{addr} (does not monitor {service_name!r}; it monitors {names})")
                seen.add("name")
            elif self.check_master_state(state, service_name):
                # It had none a moment ago (or its answer was lost): say what it says now.
                asked.append(f"{addr} (now names {host_port(str(state['ip']), int(state['port']))})")
            else:
                primary = host_port(str(state.get("ip")), int(state.get("port") or 0))
                asked.append(f"{addr} (sees the primary {primary} as down: flags {state.get('flags')})")
                seen.add("primary")
        if refused:
            has = "a password that they refuse" if self.parsed.sentinel_password else "no password"
            return SentinelAuthError(
                f"the Sentinels of {service_name!r} refused mqorder's login ({'; '.join(refused)}): "
                f"it gave them {has}. Sentinel's password is separate from the data nodes' (the "
                "URL's user:password@): set sentinel_password=... in the URL's query, or "
                "MQORDER_SENTINEL_PASSWORD"
            )
        todo = []
        if "down" in seen:
            todo.append("start the Sentinels that did not answer, or fix their host:port in the URL")
        if "name" in seen:
            todo.append(f"check the master name: the URL's /{service_name} must be the <name> of the "
                        "Sentinels' 'sentinel monitor <name> <ip> <port> <quorum>'")
        if "primary" in seen:
            todo.append("start the primary, or let the Sentinels promote a replica (that takes a quorum "
                        "of Sentinels and a healthy replica)")
        if not todo:
            todo.append("try again: a failover may have been under way")
        hint = "; ".join(todo)
        return MasterNotFoundError(
            f"no Sentinel named a primary for service {service_name!r}; asked {', '.join(asked)}. "
            f"{hint[0].upper()}{hint[1:]}"
        )


def sentinel_credentials(password: str | None, username: str | None,
                         timeout: float = SENTINEL_TIMEOUT_S) -> dict[str, Any]:
    """Keywords of a connection to a Sentinel: its own credentials (never the data nodes': redis-py
    sends those to the Sentinels only if told to) and a short timeout. Plain values only, so
    Celery's ``broker_transport_options`` can carry them (kombu's ``sentinel_kwargs``)."""
    out: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if password:
        out["password"] = password
    if username:
        out["username"] = username
    return out


def _sentinel_kwargs(parsed: SentinelURL, client_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``sentinel_credentials`` with the client's timeout if shorter, and no retries:
    ``discover_master`` already moves on to the next Sentinel when one fails, while
    ``redis.Redis``'s default (3 retries with exponential backoff) made one refused or dead
    Sentinel cost seconds per new connection (23 s measured for three refusing a password).
    """
    given = [float(t) for t in (client_kwargs.get(k) for k in _URL_TIMEOUTS) if t is not None]
    timeout = min([SENTINEL_TIMEOUT_S, *given])
    out = sentinel_credentials(parsed.sentinel_password, parsed.sentinel_username, timeout)
    out["retry"] = Retry(NoBackoff(), 0)
    return out


def _url_keywords(parsed: SentinelURL | ClusterURL, client_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The caller's keywords under the URL's credentials, TLS and timeouts (the URL wins, as
    ``from_url``'s query does): for the data nodes of a Sentinel set or of a cluster."""
    kw = dict(client_kwargs)
    if parsed.username is not None:
        kw["username"] = parsed.username
    if parsed.password is not None:
        kw["password"] = parsed.password
    if parsed.ssl:
        kw["ssl"] = True
    if parsed.socket_timeout is not None:
        kw["socket_timeout"] = parsed.socket_timeout
    if parsed.socket_connect_timeout is not None:
        kw["socket_connect_timeout"] = parsed.socket_connect_timeout
    return kw


def _data_kwargs(parsed: SentinelURL, client_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``master_for`` gets: ``_url_keywords`` and the URL's db."""
    kw = _url_keywords(parsed, client_kwargs)
    kw["db"] = parsed.db
    return kw


def _sentinel(parsed: SentinelURL, client_kwargs: dict[str, Any]) -> MqorderSentinel:
    return MqorderSentinel(parsed, list(parsed.sentinels),
                           sentinel_kwargs=_sentinel_kwargs(parsed, _data_kwargs(parsed, client_kwargs)))


def connect_cluster(url: str, **client_kwargs: Any) -> ClusterClient:
    """A ``ClusterClient`` for a ``redis+cluster://`` URL: the listed nodes are only where the
    slot map is first read; every node of the cluster is then reached as the map says, and a
    failover or a migration is followed (``mqorder.store.cluster_route``). A partial cluster
    (``require_full_coverage`` off) still serves the slots whose primaries are up.

    Unlike a plain client, this one connects here: redis-py reads the slot map in the constructor.
    So its failure is said here, as ``Broker.ping`` says a plain Redis's (``cluster_connect_error``):
    ``BrokerUnavailableError`` when no listed node answers or lets us in, ``ConfigError`` when
    the URL names a Redis that is not a cluster node."""
    parsed = parse_cluster_url(url)
    kw = _url_keywords(parsed, client_kwargs)
    nodes = [ClusterNode(h, p) for h, p in parsed.startup_nodes]
    try:
        return ClusterClient(startup_nodes=nodes, require_full_coverage=False, **kw)
    except (RedisClusterException, redis.RedisError) as exc:
        raise cluster_connect_error(url, parsed, exc) from exc


def cluster_connect_error(url: str, parsed: ClusterURL, exc: Exception) -> BrokerUnavailableError | ConfigError:
    """What a failure to read the slot map means, and what to do. redis-py raises one
    ``RedisClusterException`` ("cannot be connected") whatever happened, caused by the last
    listed node's error, which tells the cases apart."""
    where = f"the Redis Cluster at {redact_cluster_url(url)}"
    listed = ", ".join(host_port(h, p) for h, p in parsed.startup_nodes)
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    reply = cause.__context__ if isinstance(cause, RedisClusterException) else None
    if isinstance(reply, redis.ResponseError):
        # A node answered CLUSTER SLOTS with an error (redis-py says "Cluster mode is not enabled").
        if "cluster support disabled" in str(reply):
            return ConfigError(
                f"{redact_cluster_url(url)} names no Redis Cluster: a listed node ({listed}) is a Redis with "
                f"cluster mode off (CLUSTER SLOTS: {reply}). For a single Redis use redis://host:port/db; for "
                "a cluster, list nodes of it (cluster-enabled yes)"
            )
        return ConfigError(
            f"{where}: a listed node ({listed}) refused CLUSTER SLOTS ({reply}), which a cluster client "
            "needs to find the slots; allow it for the URL's user (ACL), or check that the node is a cluster node"
        )
    if isinstance(cause, redis.AuthenticationError):
        return BrokerUnavailableError(
            f"cannot log in to {where} (listed nodes: {listed}): {str(cause).rstrip('.')}. Fix the "
            "password (user:password@) in the URL"
        )
    return BrokerUnavailableError(
        f"cannot reach {where}: none of its listed nodes ({listed}) gave the slot map (last error: "
        f"{str(cause).rstrip('.')}). Start the cluster's nodes, or list nodes of a running cluster in the URL"
    )


def connect(url: str, *, sentinel_password: str | None = None, **client_kwargs: Any) -> redis.Redis:
    """A Redis client for store URL ``url``; ``client_kwargs`` as ``redis.Redis`` takes them.

    A Sentinel URL gives a client of the current primary that follows failovers by itself (see the
    module docstring); ``sentinel_password`` is the Sentinels' password when the URL's query names
    none (``mqorder.store.urls.parse_sentinel_url``). For a plain or a Sentinel URL no connection
    is made here: the first command connects, so a down Redis is an error of the first command, as
    with ``from_url``. ``ConfigError`` if ``url`` is a malformed Sentinel URL. A Redis Cluster URL
    (``redis+cluster://``) gives a ``ClusterClient`` (``connect_cluster``), which reads the slot map
    here: an unreachable cluster is a ``BrokerUnavailableError`` here, a URL naming a Redis that is
    not a cluster node a ``ConfigError``.
    """
    if is_cluster_url(url):
        return cast(redis.Redis, connect_cluster(url, **client_kwargs))
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **client_kwargs)
    parsed = parse_sentinel_url(url, sentinel_password=sentinel_password)
    data = _data_kwargs(parsed, client_kwargs)
    data["connection_class"] = DemotionAwareSSLConnection if parsed.ssl else DemotionAwareConnection
    client: redis.Redis = _sentinel(parsed, client_kwargs).master_for(parsed.master_name, redis_class=redis.Redis, **data)
    return client


def sentinel_client(url: str, *, sentinel_password: str | None = None) -> Sentinel | None:
    """The ``Sentinel`` of a Sentinel URL (to ask the Sentinels themselves: ``doctor``, tests),
    ``None`` for a plain URL. ``discover_master`` on it raises ``SentinelAuthError`` when the
    Sentinels refuse the password."""
    if not is_sentinel_url(url):
        return None
    return _sentinel(parse_sentinel_url(url, sentinel_password=sentinel_password), {})


def close(client: redis.Redis) -> None:
    """Close ``client``'s connections and, for a Sentinel client, its connections to the Sentinels
    (``client.close()`` alone leaves those open until garbage collection)."""
    client.close()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    if isinstance(manager, Sentinel):
        manager.close()
