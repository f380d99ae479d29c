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
from it, and ``mqorder doctor`` reads it to check every Sentinel.
"""

from __future__ import annotations

import ipaddress
import math
import os
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


def _host_port(url: str, item: str) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise _refuse(url, "an empty host in the Sentinel list (two commas, or a comma at an end)")
    if item.startswith("["):
        host, close, rest = item[1:].partition("]")
        if not close:
            raise _refuse(url, f"host {item!r} opens '[' without closing it")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _refuse(url, f"host {item!r} is not a bracketed IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise _refuse(url, f"host {item!r} has {rest!r} after the address; write [addr]:port")
        port_text = rest[1:] if rest else None
    else:
        if item.count(":") > 1:
            raise _refuse(url, f"host {item!r}: write an IPv6 address in brackets, [addr]:port")
        host, colon, port_text_ = item.partition(":")
        port_text = port_text_ if colon else None
        if not host:
            raise _refuse(url, f"host {item!r} has a port but no host name")
    if port_text is None:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise _refuse(url, f"host {item!r} has bad port {port_text!r}; a port is 1-65535 "
                           f"(Sentinel's is {DEFAULT_SENTINEL_PORT}, the default)")
    return host, int(port_text)


def _seconds(url: str, key: str, value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = math.nan
    if not math.isfinite(s) or s <= 0:
        raise _refuse(url, f"{key}={value!r} is not a positive number of seconds")
    return s


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
    # netloc: urlsplit's hostname/port understand one host only; split the list ourselves.
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username: str | None = None
    password: str | None = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon and username is not None:
            # redis-py reads "redis://secret@host" as a password-only URL; be as explicit as the
            # form: a lone userinfo is ambiguous, so refuse it instead of guessing.
            raise _refuse(url, "credentials without ':' are ambiguous; write ':password@' "
                               "(password only) or 'user:password@'")
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

    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise _refuse(url, "the query is not key=value pairs joined by '&'") from None
    for key, value in pairs:
        if key not in QUERY_PARAMS:
            raise _refuse(url, f"unknown query parameter {key!r}; allowed: {', '.join(QUERY_PARAMS)}")
        if key in query:
            raise _refuse(url, f"query parameter {key!r} is given twice")
        query[key] = value

    ssl = scheme == "rediss+sentinel"
    if "ssl" in query:
        flag = query["ssl"].lower()
        if flag not in _TRUE + _FALSE:
            raise _refuse(url, f"ssl={query['ssl']!r} is not true or false")
        if ssl and flag in _FALSE:
            raise _refuse(url, "rediss+sentinel:// means TLS, but the query says ssl=false")
        ssl = flag in _TRUE
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
        socket_timeout=_seconds(url, "socket_timeout", query["socket_timeout"]) if "socket_timeout" in query else None,
        socket_connect_timeout=(_seconds(url, "socket_connect_timeout", query["socket_connect_timeout"])
                                if "socket_connect_timeout" in query else None),
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
