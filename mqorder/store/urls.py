"""Store URLs that name a Redis Sentinel deployment instead of one Redis.

Production Redis runs as a primary with replicas watched by Sentinels, which promote a replica when
the primary dies. A client must then not be given the primary's address (it changes on a
failover) but the Sentinels' addresses and the name they monitor the primary under::

    redis+sentinel://[[user]:password@]host:port[,host:port...]/<master-name>[/<db>][?query]
    rediss+sentinel://...   (the same, with TLS to the data nodes)

- ``user``/``password`` in the netloc are the DATA nodes' credentials (the primary and replicas,
  Redis ``requirepass``/ACL), exactly as in a ``redis://`` URL.
- Sentinel's own credentials are separate (Sentinel's ``requirepass``): the query's
  ``sentinel_password`` and ``sentinel_username``; without them the keyword ``sentinel_password``
  of :func:`parse_sentinel_url` (the ``sentinel_password`` setting), else the environment variable
  ``MQORDER_SENTINEL_PASSWORD``. The URL's query wins, so a URL that says everything means the same
  everywhere (a Spark executor, a subprocess).
- A host without a port is on 26379, Sentinel's port. ``db`` defaults to 0. IPv6 hosts are
  bracketed: ``[::1]:26379``.
- Query: ``sentinel_password``, ``sentinel_username``, ``ssl`` (``true``/``false``; the
  ``rediss+sentinel`` scheme means ``true``), ``socket_timeout`` and ``socket_connect_timeout``
  (seconds, for the data nodes and the Sentinels). Anything else is refused: a misspelt
  ``sentinel_pasword`` silently ignored would show up as an authentication error much later.

This module parses only (no Redis connection, no Celery): ``mqorder.store.connect`` builds clients
from a :class:`SentinelURL`, ``mqorder.celery.broker`` derives kombu's ``sentinel://`` transport
from it, and ``mqorder doctor`` reads it to check every Sentinel. Its pieces (a host list, the
credentials, the query, the TLS flag) are shared with ``mqorder.store.cluster_urls`` (Redis
Cluster URLs have the same netloc and query rules), each taking the caller's ``refuse`` so an
error shows the form of the URL the user meant to write.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from mqorder.errors import ConfigError

#: ``rediss+sentinel`` is TLS to the data nodes (the Sentinels are reached in plain TCP).
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
#: Sentinel's default port, for a host given without one.
DEFAULT_SENTINEL_PORT = 26379
#: Sentinel's own password when neither the URL's query nor the caller gives one.
SENTINEL_PASSWORD_ENV = "MQORDER_SENTINEL_PASSWORD"
#: The query parameters a sentinel URL may carry.
QUERY_PARAMS = ("sentinel_password", "sentinel_username", "ssl", "socket_timeout", "socket_connect_timeout")
#: What every refusal shows, so the fix is on the screen.
URL_FORM = (
    "redis+sentinel://[[user]:password@]host:port[,host:port...]/<master-name>[/<db>]"
    "[?sentinel_password=...&sentinel_username=...&ssl=true&socket_timeout=...]"
)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL: where the Sentinels are and what to ask them for.

    Passwords are left out of ``repr`` so a logged or asserted ``SentinelURL`` leaks nothing.
    """

    #: The Sentinels' ``(host, port)``, in the URL's order (redis-py asks them in turn).
    sentinels: tuple[tuple[str, int], ...]
    #: The name the Sentinels monitor the primary under (``sentinel monitor <name> ...``).
    master_name: str
    db: int = 0
    #: The data nodes' credentials (primary and replicas).
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: Sentinel's own credentials (its ``requirepass``), separate from the data nodes'.
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    #: TLS to the data nodes (``rediss+sentinel://`` or ``?ssl=true``).
    ssl: bool = False
    #: Seconds; ``None``: the caller's (``Broker`` sets its own socket timeouts).
    socket_timeout: float | None = None
    socket_connect_timeout: float | None = None

    def to_url(self) -> str:
        """The URL back, in the canonical form (every part explicit, credentials quoted): what a
        process that must rebuild the client elsewhere (a Spark executor) is handed."""
        scheme = "rediss+sentinel" if self.ssl else "redis+sentinel"
        hosts = ",".join(host_port(h, p) for h, p in self.sentinels)
        query = []
        if self.sentinel_username is not None:
            query.append(f"sentinel_username={quote(self.sentinel_username, safe='')}")
        if self.sentinel_password is not None:
            query.append(f"sentinel_password={quote(self.sentinel_password, safe='')}")
        if self.socket_timeout is not None:
            query.append(f"socket_timeout={self.socket_timeout:g}")
        if self.socket_connect_timeout is not None:
            query.append(f"socket_connect_timeout={self.socket_connect_timeout:g}")
        q = ("?" + "&".join(query)) if query else ""
        return f"{scheme}://{self.userinfo}{hosts}/{quote(self.master_name, safe='')}/{self.db}{q}"

    @property
    def userinfo(self) -> str:
        """The data nodes' credentials as a URL writes them (``user:password@``, quoted), or ``""``."""
        if self.username is None and self.password is None:
            return ""
        auth = quote(self.username or "", safe="")
        if self.password is not None:
            auth += ":" + quote(self.password, safe="")
        return auth + "@"


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_sentinel_url(url: object) -> bool:
    """Whether ``url`` is meant as a Sentinel URL (by its scheme; it may still be malformed)."""
    if not isinstance(url, str):
        return False
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in SENTINEL_SCHEMES


#: Builds the error for a bad part of ``url``: ``refuse(url, what is wrong)``.
Refuse = Callable[[str, str], ConfigError]


def _refuse(url: str, what: str) -> ConfigError:
    return ConfigError(f"bad Sentinel URL {redact_sentinel_url(url)!r}: {what}. The form is {URL_FORM}")


def redact_sentinel_url(url: str) -> str:
    """The URL with both passwords hidden (the netloc's and any ``*password*`` query value): safe to
    log and to put in errors. No urlsplit, so a malformed URL is still shown without its secrets;
    it also serves kombu's ``sentinel://`` URLs (``mqorder.store.brokers.redact_url``)."""
    head, sep, rest = url.partition("://")
    if not sep:
        return url
    # The netloc ends at the first '/', '?' or '#' after the credentials' '@' (an unquoted '/' in a
    # password must not cut the netloc short and leave the rest of the password in the "path").
    q = rest.find("?")
    at_ = rest.rfind("@", 0, q if q != -1 else len(rest))
    netloc_end = len(rest)
    for ch in "/?#":
        i = rest.find(ch, at_ + 1)
        if i != -1:
            netloc_end = min(netloc_end, i)
    netloc, tail = rest[:netloc_end], rest[netloc_end:]
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    path, qmark, query = tail.partition("?")
    if qmark:
        items = []
        for item in query.split("&"):
            key, eq, _value = item.partition("=")
            items.append(f"{key}=***" if eq and "password" in key.lower() else item)
        tail = f"{path}?{'&'.join(items)}"
    return f"{head}://{netloc}{tail}"


def _host_port(url: str, item: str, *, refuse: Refuse = _refuse, default_port: int = DEFAULT_SENTINEL_PORT,
               role: str = "Sentinel") -> tuple[str, int]:
    """One ``host[:port]`` of a host list (``[addr]:port`` for IPv6); ``default_port`` without one."""
    item = item.strip()
    if not item:
        raise refuse(url, f"an empty host in the {role} list (two commas, or a comma at an end)")
    if item.startswith("["):
        host, close, rest = item[1:].partition("]")
        if not close:
            raise refuse(url, f"host {item!r} opens '[' without closing it")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise refuse(url, f"host {item!r} is not a bracketed IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise refuse(url, f"host {item!r} has {rest!r} after the address; write [addr]:port")
        port_text = rest[1:] if rest else None
    else:
        if item.count(":") > 1:
            raise refuse(url, f"host {item!r}: write an IPv6 address in brackets, [addr]:port")
        host, colon, port_text_ = item.partition(":")
        port_text = port_text_ if colon else None
        if not host:
            raise refuse(url, f"host {item!r} has a port but no host name")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise refuse(url, f"host {item!r} has bad port {port_text!r}; a port is 1-65535 "
                          f"({role}'s is {default_port}, the default)")
    return host, int(port_text)


def _seconds(url: str, key: str, value: str, *, refuse: Refuse = _refuse) -> float:
    try:
        s = float(value)
    except ValueError:
        s = math.nan
    if not math.isfinite(s) or s <= 0:
        raise refuse(url, f"{key}={value!r} is not a positive number of seconds")
    return s


def _credentials(url: str, netloc: str, *, refuse: Refuse = _refuse) -> tuple[str | None, str | None, str]:
    """``(username, password, host list)`` of a netloc (``[[user]:password@]hosts``), unquoted.

    urlsplit's ``hostname``/``port`` understand one host only, so the list is split here."""
    userinfo, at, hostlist = netloc.rpartition("@")
    username: str | None = None
    password: str | None = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon and username is not None:
            # redis-py reads "redis://secret@host" as a password-only URL; be as explicit as the
            # form: a lone userinfo is ambiguous, so refuse it instead of guessing.
            raise refuse(url, "credentials without ':' are ambiguous; write ':password@' "
                              "(password only) or 'user:password@'")
    return username, password, hostlist


def _query(url: str, query: str, allowed: tuple[str, ...], *, refuse: Refuse = _refuse) -> dict[str, str]:
    """The query as a dict; an unknown or repeated parameter is refused (a misspelt one silently
    ignored would surface much later as a different error)."""
    out: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise refuse(url, "the query is not key=value pairs joined by '&'") from None
    for key, value in pairs:
        if key not in allowed:
            raise refuse(url, f"unknown query parameter {key!r}; allowed: {', '.join(allowed)}")
        if key in out:
            raise refuse(url, f"query parameter {key!r} is given twice")
        out[key] = value
    return out


def _tls(url: str, scheme: str, tls_scheme: str, query: dict[str, str], *, refuse: Refuse = _refuse) -> bool:
    """TLS from the scheme (``tls_scheme`` means TLS) and the query's ``ssl``, which may not contradict it."""
    ssl = scheme == tls_scheme
    if "ssl" in query:
        flag = query["ssl"].lower()
        if flag not in _TRUE + _FALSE:
            raise refuse(url, f"ssl={query['ssl']!r} is not true or false")
        if ssl and flag in _FALSE:
            raise refuse(url, f"{tls_scheme}:// means TLS, but the query says ssl=false")
        ssl = flag in _TRUE
    return ssl


def _timeouts(url: str, query: dict[str, str], *, refuse: Refuse = _refuse) -> tuple[float | None, float | None]:
    """``(socket_timeout, socket_connect_timeout)`` from the query (``None``: not given)."""
    t, ct = (_seconds(url, key, query[key], refuse=refuse) if key in query else None
             for key in ("socket_timeout", "socket_connect_timeout"))
    return t, ct


def parse_sentinel_url(url: str, *, sentinel_password: str | None = None) -> SentinelURL:
    """Parse a ``redis+sentinel://`` (or ``rediss+sentinel://``) URL; ``ConfigError`` saying what
    is wrong and showing the form if it is not one.

    ``sentinel_password`` is the Sentinels' password when the URL's query has none (the
    ``sentinel_password`` setting); without either, ``MQORDER_SENTINEL_PASSWORD`` is used.
    """
    if not isinstance(url, str) or not is_sentinel_url(url):
        shown = redact_sentinel_url(url) if isinstance(url, str) else repr(url)
        raise ConfigError(f"{shown!r} is not a Sentinel URL (scheme redis+sentinel:// or "
                          f"rediss+sentinel://). The form is {URL_FORM}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise _refuse(url, str(exc)) from None
    if parts.fragment:
        raise _refuse(url, f"unexpected fragment '#{parts.fragment}'")
    scheme = parts.scheme.lower()
    username, password, hostlist = _credentials(url, parts.netloc)
    if not hostlist:
        raise _refuse(url, "no Sentinel host; name at least one host:port")
    sentinels = tuple(_host_port(url, item) for item in hostlist.split(","))

    path = parts.path
    if path.endswith("/") and len(path) > 1:
        path = path[:-1]
    segments = path[1:].split("/") if path.startswith("/") else []
    if not segments or not segments[0]:
        raise _refuse(url, "no master name; put the name the Sentinels monitor the primary "
                           "under after the hosts: /<master-name>")
    if len(segments) > 2:
        raise _refuse(url, f"path {parts.path!r} has extra segments; it is /<master-name> or "
                           "/<master-name>/<db>")
    master_name = unquote(segments[0])
    if any(c.isspace() for c in master_name):
        raise _refuse(url, f"master name {master_name!r} contains white space")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise _refuse(url, f"db {segments[1]!r} is not a non-negative integer")
        db = int(segments[1])

    query = _query(url, parts.query, QUERY_PARAMS)
    ssl = _tls(url, scheme, "rediss+sentinel", query)
    socket_timeout, socket_connect_timeout = _timeouts(url, query)
    s_password = query.get("sentinel_password")
    if s_password is None:
        s_password = sentinel_password if sentinel_password is not None else os.environ.get(SENTINEL_PASSWORD_ENV)
    return SentinelURL(
        sentinels=sentinels,
        master_name=master_name,
        db=db,
        username=username,
        password=password,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=s_password or None,
        ssl=ssl,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
    )


def with_sentinel_password(url: str, password: str) -> str:
    """``url`` with ``sentinel_password`` in its query if it is a Sentinel URL that names none;
    any other URL as it is. So a URL built from settings (``MQORDER_SENTINEL_PASSWORD``) carries
    everything a process elsewhere needs to connect (a Spark executor sees no driver environment)."""
    if not is_sentinel_url(url):
        return url
    base, _, fragment = url.partition("#")
    _, qmark, query = base.partition("?")
    if any(item.partition("=")[0] == "sentinel_password" for item in query.split("&")):
        return url
    sep = "&" if qmark and query else ("" if qmark else "?")
    out = f"{base}{sep}sentinel_password={quote(password, safe='')}"
    return f"{out}#{fragment}" if fragment else out
