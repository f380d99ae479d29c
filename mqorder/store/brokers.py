"""Named Redis brokers: RocketMQ's broker names mapped onto Redis URLs.

The default broker (``broker-a``) is ``MQORDER_REDIS_URL`` and also plays the NameServer's role:
topic routes, group subscriptions and client heartbeats live there. More brokers may be named with
``MQORDER_BROKERS`` (a JSON object of name to URL); a topic's queues can then be spread over them.
Any of these URLs may name a Sentinel deployment (``redis+sentinel://``, ``mqorder.store.urls``):
the broker's client then follows the primary across failovers (``mqorder.store.connect``). Or a
Redis Cluster (``redis+cluster://``, ``mqorder.store.cluster_urls``): the store only, never
Celery's broker (``check_celery_broker_url`` says why and what to use instead).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar, cast, overload
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import redis
from redis.connection import parse_url
from redis.crc import key_slot
from redis.sentinel import MasterNotFoundError

from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.model import MessageQueue
from mqorder.names import check_name
from mqorder.store.cluster_route import ClusterClient
from mqorder.store.cluster_urls import (
    CLUSTER_SCHEMES,
    CLUSTER_URL_FORM,
    cluster_mode_hint,
    is_cluster_url,
    parse_cluster_url,
    redact_cluster_url,
)
from mqorder.store.connect import close as close_client
from mqorder.store.connect import connect
from mqorder.store.failures import setup_hint
from mqorder.store.scripts import Scripts
from mqorder.store.urls import SENTINEL_SCHEMES, URL_FORM, is_sentinel_url, parse_sentinel_url, redact_sentinel_url

log = logging.getLogger(__name__)

DEFAULT_BROKER_NAME = "broker-a"
#: How long ``Broker.replicas_of`` trusts a shard's replica count.
REPLICA_COUNT_TTL_S = 5.0
_SCHEMES = ("redis", "rediss", "unix")
#: kombu's Redis Sentinel transport (``sentinel://h1:26379;sentinel://h2:26379``): for Celery's
#: own broker, with the master name from ``MQORDER_CELERY_SENTINEL_MASTER`` (``mqorder.celery.broker``).
KOMBU_SENTINEL_SCHEME = "sentinel"
#: RabbitMQ, through py-amqp (kombu's ``amqp``/``pyamqp`` transports; ``amqps`` is AMQP over TLS).
#: Accepted for Celery's own broker only: mqorder's store is always Redis.
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
#: kombu's failover list (``amqp://h1//;amqp://h2//``): a ``;`` that starts another URL.
_FAILOVER_SEP = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``: safe to log and to put in errors.

    A kombu failover list (``amqp://u:p1@h1//;amqp://u:p2@h2//``) is redacted URL by URL: parsed
    as one URL, the passwords after the first would be shown.
    """
    parts = _FAILOVER_SEP.split(url)
    if len(parts) > 1:
        return ";".join(_redact_one(u) for u in parts)
    return _redact_one(url)


def _redact_one(url: str) -> str:
    scheme = url.partition("://")[0].lower()
    if scheme in (*SENTINEL_SCHEMES, KOMBU_SENTINEL_SCHEME):
        # Two passwords (the data nodes' in the netloc, the Sentinels' in the query) and a host
        # list that urlsplit cannot take apart.
        return redact_sentinel_url(url)
    if scheme in CLUSTER_SCHEMES:
        return redact_cluster_url(url)  # a host list, again
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        # No password where urlsplit looks; but one holding an unquoted '/', '?' or '#' ends the
        # netloc early and lands in the path, query or fragment: hide it the Sentinel way.
        return redact_sentinel_url(url) if "@" in url else url
    user = parts.username or ""
    # The host and port as written (``parts.port`` would raise on a bad port: the URL an error
    # about that port must show).
    netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_redis_url(url: object, what: str = "MQORDER_REDIS_URL") -> str:
    """A store URL: one Redis (``redis://``, ``rediss://``, ``unix://``), a Sentinel deployment
    (``redis+sentinel://``, ``rediss+sentinel://``) or a Redis Cluster (``redis+cluster://``,
    ``rediss+cluster://``); the last two are parsed here so a malformed one stops the start."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{what} must be a non-empty redis://, rediss://, redis+sentinel:// or redis+cluster:// "
                          f"URL, got {url!r}")
    if is_sentinel_url(url) or is_cluster_url(url):
        try:
            parse_sentinel_url(url) if is_sentinel_url(url) else parse_cluster_url(url)
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        return url
    scheme = _scheme(url, what)
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"{what}={redact_url(url)!r} has scheme {scheme!r}; use redis://host:port/db, "
            f"rediss:// for TLS, unix:///path/to/socket, a Sentinel deployment: {URL_FORM}, "
            f"or a Redis Cluster: {CLUSTER_URL_FORM}"
        )
    _check_redis_port(url, scheme, what)
    _check_db(url, scheme, what)
    try:
        parse_url(url)  # what redis.Redis.from_url will do with it: its errors, here and clear
    except ValueError as exc:
        raise ConfigError(
            f"{what}={redact_url(url)!r} is not a valid Redis URL: {str(exc).rstrip('.')}. The form is "
            "redis://[[user]:password@]host:port/db[?socket_timeout=...], rediss:// for TLS, "
            "unix:///path/to/socket[?db=...]"
        ) from None
    return url


def _scheme(url: str, what: str) -> str:
    """The scheme of a URL urlsplit can take apart (``ConfigError`` if it cannot: an unclosed
    ``[`` of an IPv6 host, say)."""
    try:
        return urlsplit(url).scheme
    except ValueError as exc:
        raise ConfigError(f"{what}={redact_url(url)!r} is not a URL ({exc})") from None


def _check_redis_port(url: str, scheme: str, what: str) -> None:
    """``_check_port`` of a Redis URL (a socket's, ``unix://``, has a path, not a host and port)."""
    if scheme != "unix":
        _check_port(url, what, "redis://host:6379/0 (6379 is Redis's default)")


def _check_db(url: str, scheme: str, what: str) -> None:
    """``ConfigError`` if the URL's database is not a number: redis-py reads a path of
    ``redis://host:6379/orders`` as no database at all (db 0, quietly: another application's
    keys, maybe), and a ``?db=`` that is not a number as a bare ``ValueError``. Or if it names two
    databases (``redis://host/3?db=2``): redis-py quietly uses the query's, and which one the
    writer meant cannot be known."""
    parts = urlsplit(url)
    dbs = [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "db"]
    path = "" if scheme == "unix" else parts.path.strip("/")
    for db in ([path] if path else []) + dbs:
        if not db.isdigit():
            raise ConfigError(
                f"{what}={redact_url(url)!r} names database {db!r}: a Redis database is a number "
                "(redis://host:6379/0 is database 0; unix:///path/to/socket?db=0)")
    named = ([f"/{path}"] if path else []) + [f"db={db}" for db in dbs]
    if len({int(db) for db in ([path] if path else []) + dbs}) > 1:
        raise ConfigError(
            f"{what}={redact_url(url)!r} names more than one database ({' and '.join(named)}); name one, in the "
            "path (redis://host:6379/2) or, for a socket, in the query (unix:///path/to/socket?db=2)")


def _check_port(url: str, what: str, example: str) -> None:
    """``ConfigError`` naming the URL (its password hidden) if its port is not 1-65535: redis-py
    would fail on it with a bare ``ValueError: Port out of range``, kombu later still, and a port 0
    would quietly be Redis's default port. No port at all is fine (the default)."""
    netloc = urlsplit(url).netloc
    host = netloc.rpartition("@")[2]
    if host.startswith("["):  # [IPv6]:port
        after = host.partition("]")[2]
        port = after[1:] if after.startswith(":") else ""
    else:
        port = host.partition(":")[2]
    if not port or (port.isdigit() and 1 <= int(port) <= 65535):
        return
    if "@" not in netloc and "@" in url.partition("://")[2]:
        # "redis://:pa/ss@host/0": the "port" is a piece of the password, and so may be anything
        # before the last '@': none of it is shown.
        shown = f"{url.partition('://')[0]}://***@{url.rpartition('@')[2]}"
        raise ConfigError(f"{what}={shown!r} cannot be read: a '/', '?' or '#' ends its host:port "
                          "before the '@' of its credentials; percent-encode those characters in a user name "
                          "or password (%2F, %3F, %23)")
    raise ConfigError(f"{what}={redact_url(url)!r} has port {port!r}; a port is a number from 1 to 65535, "
                      f"as in {example}")


def celery_transport(url: str) -> Literal["redis", "amqp"]:
    """Which kind of broker a (checked) Celery broker URL names: its settings differ
    (``mqorder.celery.broker``)."""
    scheme = urlsplit(_FAILOVER_SEP.split(url)[0]).scheme
    return "amqp" if scheme in AMQP_SCHEMES else "redis"


#: The kinds of Celery broker, in the order an error names them.
_KINDS = ("Redis", "Redis Sentinel", "RabbitMQ")


def cluster_celery_broker_error(url: str, what: str = "MQORDER_CELERY_BROKER_URL") -> ConfigError:
    """Why Celery's broker cannot be a Redis Cluster, and the three ways out.

    kombu has no cluster transport: its Redis transport polls all of a worker's queues with one
    multi-key ``BRPOP`` and moves unacked messages with ``MULTI``/``EXEC`` over keys of many slots,
    which a cluster refuses (``CROSSSLOT``). Said when the settings or the Celery app are
    configured, not at the first task a worker would have failed to fetch.
    """
    return ConfigError(
        f"{what} {redact_url(url)!r} is a Redis Cluster, and Celery's broker cannot run on one: kombu has no "
        "Redis Cluster transport (its Redis transport reads every queue with one multi-key BRPOP and uses "
        "MULTI over keys in many hash slots, which a cluster refuses with CROSSSLOT). Keep MQORDER_REDIS_URL "
        "on the cluster (mqorder's store) and set MQORDER_CELERY_BROKER_URL to a plain Redis "
        "(redis://host:6379/0), a Sentinel deployment (redis+sentinel://host:26379,host:26380/<master-name>) "
        "or RabbitMQ (amqp://user:password@host:5672/vhost): it carries only mqorder's small tasks"
    )


def check_celery_broker_url(url: object, what: str = "MQORDER_CELERY_BROKER_URL") -> str:
    """Celery's own broker: Redis (as the store) or RabbitMQ. Only ``consume_request``,
    ``rebalance`` and ``lock_all`` tasks travel there; messages, locks and offsets stay in Redis.
    Every URL of a kombu failover list is checked, and all of them must be of one kind. A Redis
    Cluster is refused (``cluster_celery_broker_error``).

    Redis under Sentinel is either mqorder's own form (``redis+sentinel://h1,h2/<master>``, one
    URL) or kombu's (``sentinel://h1:26379;sentinel://h2:26379``, whose master name comes from
    ``MQORDER_CELERY_SENTINEL_MASTER``); ``mqorder.celery.broker`` turns either into kombu's
    transport and its options.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{what} must be a non-empty redis:// or amqp:// URL, got {url!r}")
    if is_sentinel_url(url):
        return check_redis_url(url, what)
    kinds = set()
    for one in _FAILOVER_SEP.split(url):
        if is_cluster_url(one):
            raise cluster_celery_broker_error(url, what)
        scheme = _scheme(one, what)
        if scheme in AMQP_SCHEMES:
            kinds.add("RabbitMQ")
            _check_port(one, what, "amqp://user:password@host:5672/vhost (5672 is RabbitMQ's default)")
        elif scheme in _SCHEMES:
            kinds.add("Redis")
            _check_redis_port(one, scheme, what)
        elif scheme == KOMBU_SENTINEL_SCHEME:
            kinds.add("Redis Sentinel")
            _check_port(one, what, "sentinel://host:26379 (26379 is Sentinel's default)")
        else:
            raise ConfigError(
                f"{what}={redact_url(url)!r} has scheme {scheme!r}; Celery's broker must be Redis "
                "(redis://host:port/db, rediss:// for TLS, unix:///path/to/socket), Redis under Sentinel "
                "(redis+sentinel://host:port,host:port/<master-name>, or kombu's "
                "sentinel://host:26379;sentinel://host:26380 with MQORDER_CELERY_SENTINEL_MASTER) or "
                "RabbitMQ (amqp://user:password@host:5672/vhost, amqps:// for TLS, pyamqp://)"
            )
    if len(kinds) > 1:
        raise ConfigError(
            f"{what}={redact_url(url)!r} mixes {' and '.join(k for k in _KINDS if k in kinds)} URLs; a failover list "
            "(url1;url2) must name brokers of one kind"
        )
    return url


def is_kombu_sentinel_url(url: str) -> bool:
    """kombu's ``sentinel://`` form (one URL or a ``;`` list of them)."""
    return url.partition("://")[0].lower() == KOMBU_SENTINEL_SCHEME


T = TypeVar("T")


@overload
def group_by_broker(items: Iterable[MessageQueue]) -> dict[str, list[MessageQueue]]: ...


@overload
def group_by_broker(items: Iterable[T], mq_of: Callable[[T], MessageQueue]) -> dict[str, list[T]]: ...


def group_by_broker(
    items: Iterable[Any], mq_of: Callable[[Any], MessageQueue] | None = None
) -> dict[str, list[Any]]:
    """``items`` split by the broker holding their queue, in first-seen order, each group in order.

    Every multi-queue script (``lock_batch``, ``unlock_batch``, ``assign``, ``sweep``, ``send``)
    runs on one Redis, so a batch over several brokers is one call per broker. ``mq_of`` picks the
    queue out of an item (say a ``(mq, assignee, token)`` triple); by default an item is a queue.
    """
    out: dict[str, list[Any]] = {}
    for item in items:
        mq = cast(MessageQueue, item) if mq_of is None else mq_of(item)
        out.setdefault(mq.broker_name, []).append(item)
    return out


def _raw_reply(response: object, **options: object) -> object:
    return response


#: Connections one client may open at once. redis-py's pool stops at 100 (``MaxConnectionsError``),
#: which a worker reaches with ``-P gevent -c 500``, or with key-ordered lanes (``key_request``)
#: calling ``ctx.still_owner()`` from hundreds of threads or greenlets at once; idle connections
#: cost nothing until used.
MAX_CONNECTIONS = 10_000
#: Socket (and connect) timeout of a broker connection made without one: a Redis that does not
#: answer within it is reported unavailable rather than hanging a worker. Producers pass
#: ``MQORDER_SEND_MSG_TIMEOUT_MS`` instead (also 3 s by default).
DEFAULT_SOCKET_TIMEOUT_S = 3.0
#: Seconds between redis-py's PINGs on a connection idle that long, so a dead connection (a
#: restarted Redis, a dropped NAT entry) is found before a real command uses it.
HEALTH_CHECK_INTERVAL_S = 30


class Broker:
    """One named Redis with its registered scripts."""

    def __init__(self, name: str, url: str, *, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S) -> None:
        self.name = check_name("broker", name)
        self.url = check_redis_url(url, f"broker {name!r} URL")
        # A Sentinel URL gives a client whose pool asks the Sentinels for the primary on every new
        # connection: the same client, its Scripts and leases carry on after a failover. A cluster
        # URL's client reads the slot map here, so an unreachable cluster fails here, not at ping.
        try:
            self.client: redis.Redis = connect(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                health_check_interval=HEALTH_CHECK_INTERVAL_S,
                max_connections=MAX_CONNECTIONS,
            )
        except (BrokerUnavailableError, ConfigError) as exc:
            raise type(exc)(f"broker {self.name!r}: {exc}") from exc
        # Stream reads are decoded by mqorder.codec from the raw reply; redis-py's per-entry
        # dict conversion would only cost time on the hot path.
        self.client.set_response_callback("XRANGE", _raw_reply)
        self.client.set_response_callback("XREAD", _raw_reply)
        self.scripts = Scripts(self.client)
        #: Cluster node name -> (when read, connected replicas): ``replicas_of``.
        self._replicas: dict[str, tuple[float, int]] = {}
        # Known once: an isinstance check against redis-py's RedisCluster goes through its ABC's
        # __instancecheck__, a few µs on every send that asks.
        self._is_cluster = isinstance(self.client, ClusterClient)
        #: ``node_identity`` was refused once (logged once, not every sweep).
        self._identity_refused = False

    @property
    def is_cluster(self) -> bool:
        """Whether this broker is a Redis Cluster (``redis+cluster://``)."""
        return self._is_cluster

    def slot_batches(self, items: Sequence[T], tag_of: Callable[[T], str]) -> list[list[T]]:
        """``items`` in batches whose keys share one hash slot: one batch on a plain Redis, where a
        multi-queue script may take any keys; one batch per slot on a cluster, where a script's
        keys must all be in one slot (``CROSSSLOT``). ``tag_of`` gives an item's hash tag
        (``MessageQueue.tag``). Callers send every batch's call in one round trip
        (``Scripts.run_pipelined``): on a cluster it goes out per node, all nodes at once."""
        if not isinstance(self.client, ClusterClient):
            return [list(items)] if items else []
        by_slot: dict[int, list[T]] = {}
        for item in items:
            by_slot.setdefault(key_slot(tag_of(item).encode()), []).append(item)
        return list(by_slot.values())

    def replicas_of(self, tag: str) -> int:
        """Online replicas of the cluster primary serving ``tag`` (0 off a cluster): what a
        ``WAIT`` on that shard can count. Read from the node (``INFO replication``), cached for
        ``REPLICA_COUNT_TTL_S``: the slot map is no guide, as ``CLUSTER SLOTS`` leaves out a
        replica that has not yet acknowledged any write."""
        if not isinstance(self.client, ClusterClient):
            return 0
        node = self.client.primary_for(tag)
        now = time.monotonic()
        cached = self._replicas.get(node.name)
        if cached is not None and now - cached[0] < REPLICA_COUNT_TTL_S:
            return cached[1]
        info = self._primary_client(tag).info("replication")
        # Online replicas only: one still in its initial sync acknowledges no WAIT yet.
        n = sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")
        self._replicas[node.name] = (now, n)
        return n

    def _primary_client(self, tag: str) -> Any:
        """A client of the primary holding ``tag``'s keys: its node's on a cluster, else ours."""
        if isinstance(self.client, ClusterClient):
            return self.client.node_client(self.client.primary_for(tag))
        return self.client

    def node_identity(self, tag: str) -> str:
        """The replication id (``master_replid``) of the primary that holds ``tag``'s keys now:
        what ``sweep.lua`` tells one node's run marks from another's by (a promoted replica gets a
        new one). Read on every call, one ``INFO replication`` per sweep and node; ``''`` when the
        server does not say, or refuses ``INFO`` (renamed away, or an ACL user without it): the
        sweep then judges by leases alone, as before it had the identity, rather than not at all."""
        try:
            info = self._primary_client(tag).info("replication")
        except redis.ResponseError as exc:
            if not self._identity_refused:
                log.warning("broker %s refuses INFO (%s): a run mark a failover left behind lapses only with "
                            "its run lease (MQORDER_RUN_LEASE_MS); allow INFO to have it swept at once",
                            self.name, exc)
                self._identity_refused = True
            return ""
        return str(info.get("master_replid", ""))

    @property
    def safe_url(self) -> str:
        """The URL with any password replaced (computed once: every send's error context quotes it)."""
        safe: str | None = getattr(self, "_safe_url", None)
        if safe is None:
            safe = self._safe_url = redact_url(self.url)
        return safe

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.RedisError as exc:
            setup = setup_hint(exc)
            if isinstance(exc, MasterNotFoundError):
                hint = ""  # the error says what to check (SentinelAuthError: what to set)
            elif setup is not None:
                hint = f": {setup}"
            else:
                hint = ". Start redis-server or point MQORDER_REDIS_URL at a running one"
            raise BrokerUnavailableError(
                f"cannot reach Redis broker {self.name!r} at {self.safe_url}: {str(exc).rstrip('.')}{hint}"
            ) from exc
        self.check_mode()

    def check_mode(self) -> None:
        """``ConfigError`` if a plain URL names one node of a Redis Cluster (``cluster_mode_hint``):
        such a client reaches only that node's slots and gets MOVED for the rest, an error that
        does not say what to change. One ``INFO cluster``; at start, not per command."""
        if self.is_cluster or is_sentinel_url(self.url):
            return
        hint = cluster_mode_hint(self.client)
        if hint is not None:
            raise ConfigError(f"broker {self.name!r} ({self.safe_url}): {hint}")

    def close(self) -> None:
        close_client(self.client)


class BrokerRegistry:
    """All brokers by name; the first one is the default (the NameServer's stand-in)."""

    def __init__(
        self,
        default_url: str,
        extra: dict[str, str] | None = None,
        *,
        default_name: str = DEFAULT_BROKER_NAME,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> None:
        self._lock = threading.Lock()
        self.default_name = default_name
        self._brokers: dict[str, Broker] = {
            default_name: Broker(default_name, default_url, socket_timeout=socket_timeout)
        }
        try:
            for name, url in (extra or {}).items():
                if name in self._brokers:
                    # Skipping it used the default's URL and dropped this one without a word.
                    raise ConfigError(
                        f"broker {name!r} is the default broker's own name, so its URL {redact_url(url)!r} "
                        f"would be ignored: the default broker is MQORDER_REDIS_URL; name the other one "
                        "differently in MQORDER_BROKERS ('broker-b')")
                self._brokers[name] = Broker(name, url, socket_timeout=socket_timeout)
        except Exception:
            self.close()  # a cluster broker connects when made: leave no client open behind the error
            raise

    @property
    def default(self) -> Broker:
        return self._brokers[self.default_name]

    @property
    def meta(self) -> redis.Redis:
        """The Redis holding topic routes, subscriptions and heartbeats."""
        return self.default.client

    @property
    def names(self) -> list[str]:
        return sorted(self._brokers)

    def get(self, name: str) -> Broker:
        try:
            return self._brokers[name]
        except KeyError:
            raise ConfigError(
                f"unknown broker {name!r}; known brokers: {', '.join(self.names)}. "
                "Name more brokers with MQORDER_BROKERS='{\"broker-b\": \"redis://...\"}'"
            ) from None

    def close(self) -> None:
        for b in self._brokers.values():
            b.close()
