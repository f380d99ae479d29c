"""Store URLs that name a Redis Cluster, and the hint for a plain URL pointed at one of its nodes.

A Redis Cluster spreads the keyspace over its primaries by hash slot (16,384 of them). A client
is given a few of its nodes only to read the slot map from; it then sends every command to the
primary serving the command's slot, and follows the cluster when a slot moves or a replica is
promoted (``mqorder.store.cluster_route``). So the URL is a list of nodes, not one address::

    redis+cluster://[[user]:password@]host:port[,host:port...][/0][?query]
    rediss+cluster://...   (the same, with TLS to every node)

- ``user``/``password`` are the nodes' credentials (Redis ``requirepass``/ACL), as in ``redis://``.
- A host without a port is on 6379. IPv6 hosts are bracketed: ``[::1]:7000``.
- The db is 0 or absent: a cluster has only db 0 (``SELECT`` other than 0 is an error there), so
  a URL naming another was written for a single Redis and is refused rather than quietly ignored.
- Query: ``ssl`` (``true``/``false``; ``rediss+cluster`` means ``true``), ``socket_timeout`` and
  ``socket_connect_timeout`` (seconds). Anything else is refused: a misspelt parameter silently
  ignored would show up much later as a different error.

The netloc, query and TLS rules are the Sentinel URL's, so the pieces are shared with
``mqorder.store.urls``. Parsing only, no connection: ``mqorder.store.connect`` builds the client
from a :class:`ClusterURL`, ``mqorder doctor`` (``mqorder.admin.doctor_cluster``) checks the
cluster it names. :func:`cluster_mode_hint` is the other way round: a plain ``redis://`` URL whose
server turns out to be a cluster node, which would answer ``MOVED`` for most keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

import redis

from mqorder.errors import ConfigError
from mqorder.store.replies import text
from mqorder.store.urls import _credentials, _host_port, _query, _timeouts, _tls, host_port, redact_sentinel_url

#: ``rediss+cluster`` is TLS to every node.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: A cluster node's port when the URL gives none (Redis's own default).
DEFAULT_CLUSTER_PORT = 6379
#: The query parameters a cluster URL may carry.
CLUSTER_QUERY_PARAMS = ("ssl", "socket_timeout", "socket_connect_timeout")
#: What every refusal shows, so the fix is on the screen.
CLUSTER_URL_FORM = (
    "redis+cluster://[[user]:password@]host:port[,host:port...][/0]"
    "[?ssl=true&socket_timeout=...&socket_connect_timeout=...] (rediss+cluster:// for TLS)"
)


@dataclass(frozen=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL: where to read the slot map from, and how to log in.

    The password is left out of ``repr`` so a logged or asserted ``ClusterURL`` leaks nothing.
    """

    #: The listed nodes' ``(host, port)``, in the URL's order: any one that answers gives the map.
    startup_nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: TLS to every node (``rediss+cluster://`` or ``?ssl=true``).
    ssl: bool = False
    #: Seconds; ``None``: the caller's (``Broker`` sets its own socket timeouts).
    socket_timeout: float | None = None
    socket_connect_timeout: float | None = None

    def to_url(self) -> str:
        """The URL back, in the canonical form (credentials quoted, db 0 explicit): what a process
        that must rebuild the client elsewhere (a Spark executor) is handed."""
        scheme = "rediss+cluster" if self.ssl else "redis+cluster"
        auth = ""
        if self.username is not None or self.password is not None:
            auth = quote(self.username or "", safe="")
            if self.password is not None:
                auth += ":" + quote(self.password, safe="")
            auth += "@"
        hosts = ",".join(host_port(h, p) for h, p in self.startup_nodes)
        query = [f"{k}={v:g}" for k, v in (("socket_timeout", self.socket_timeout),
                                            ("socket_connect_timeout", self.socket_connect_timeout)) if v is not None]
        return f"{scheme}://{auth}{hosts}/0" + (("?" + "&".join(query)) if query else "")


def is_cluster_url(url: object) -> bool:
    """Whether ``url`` is meant as a Redis Cluster URL (by its scheme; it may still be malformed)."""
    if not isinstance(url, str):
        return False
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in CLUSTER_SCHEMES


def redact_cluster_url(url: str) -> str:
    """The URL with its password shown as ``***``: safe to log and to put in errors, even when
    malformed (the Sentinel URL's redaction, which takes any netloc and host list apart)."""
    return redact_sentinel_url(url)


def _refuse(url: str, what: str) -> ConfigError:
    return ConfigError(f"bad Redis Cluster URL {redact_cluster_url(url)!r}: {what}. The form is {CLUSTER_URL_FORM}")


def parse_cluster_url(url: str) -> ClusterURL:
    """Parse a ``redis+cluster://`` (or ``rediss+cluster://``) URL; ``ConfigError`` saying what is
    wrong and showing the form if it is not one."""
    if not isinstance(url, str) or not is_cluster_url(url):
        shown = redact_cluster_url(url) if isinstance(url, str) else repr(url)
        raise ConfigError(f"{shown!r} is not a Redis Cluster URL (scheme redis+cluster:// or "
                          f"rediss+cluster://). The form is {CLUSTER_URL_FORM}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise _refuse(url, str(exc)) from None
    if parts.fragment:
        raise _refuse(url, f"unexpected fragment '#{parts.fragment}'")
    username, password, hostlist = _credentials(url, parts.netloc, refuse=_refuse)
    if not hostlist:
        raise _refuse(url, "no cluster node; name at least one host:port of the cluster")
    nodes = tuple(_host_port(url, item, refuse=_refuse, default_port=DEFAULT_CLUSTER_PORT, role="cluster node")
                  for item in hostlist.split(","))
    for i, node in enumerate(nodes):
        if node in nodes[:i]:
            # Most likely a typo in a port: the node meant is missing from the list.
            raise _refuse(url, f"node {host_port(*node)} is listed twice")
    _check_db(url, parts.path)
    query = _query(url, parts.query, CLUSTER_QUERY_PARAMS, refuse=_refuse)
    socket_timeout, socket_connect_timeout = _timeouts(url, query, refuse=_refuse)
    return ClusterURL(
        startup_nodes=nodes,
        username=username,
        password=password,
        ssl=_tls(url, parts.scheme.lower(), "rediss+cluster", query, refuse=_refuse),
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
    )


def _check_db(url: str, path: str) -> None:
    """The path is empty, ``/`` or ``/0``: a cluster has db 0 only."""
    db = path[1:] if path.startswith("/") else path
    if db.endswith("/"):
        db = db[:-1]
    if not db:
        return
    if "/" in db:
        raise _refuse(url, f"path {path!r} has extra segments; a cluster URL ends at the hosts, or at /0")
    if not db.isdigit():
        raise _refuse(url, f"db {db!r} is not a number; a cluster URL names db 0 or none")
    if int(db) != 0:
        raise _refuse(url, f"db {db} is not possible: a Redis Cluster has only db 0 (SELECT {db} is refused "
                           "there); drop the /db, and keep apart what shared this Redis by topic names or "
                           "by another cluster")


def cluster_mode_hint(client: redis.Redis) -> str | None:
    """What to tell a user whose plain ``redis://`` URL reaches a node of a Redis Cluster, or
    ``None`` when the server is not in cluster mode (or refuses ``INFO cluster``).

    Such a node answers ``MOVED`` for every key in a slot it does not serve, so most sends and
    scripts would fail with an error that does not say what to change. The hint names the
    cluster's primaries (``CLUSTER SLOTS``), so the fix can be pasted.
    """
    try:
        enabled = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
    except redis.ResponseError:
        return None  # INFO renamed or refused by an ACL: nothing to say
    if not enabled:
        return None
    pool = client.connection_pool
    host = str(pool.connection_kwargs.get("host", "?"))
    here = host_port(host, int(pool.connection_kwargs.get("port", DEFAULT_CLUSTER_PORT)))
    primaries: list[str] = []
    try:
        for entry in client.execute_command("CLUSTER SLOTS") or []:
            # A node that does not know its own address reports it as "" (its own slots).
            addr = host_port(text(entry[2][0]) or host, int(entry[2][1]))
            if addr not in primaries:
                primaries.append(addr)
    except (redis.ResponseError, IndexError, TypeError, ValueError):
        pass  # the hint still names this node
    scheme = "rediss+cluster" if issubclass(pool.connection_class, redis.SSLConnection) else "redis+cluster"
    hosts = ",".join(sorted(primaries)) or here
    return (f"this Redis ({here}) is a node of a Redis Cluster (cluster_enabled:1): a plain redis:// client "
            "reaches only the slots this node serves and gets MOVED for the others; use a cluster URL, "
            f"{scheme}://[user:password@]{hosts}/ (the form is {CLUSTER_URL_FORM})")
