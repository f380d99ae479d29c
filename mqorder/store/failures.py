"""Redis failures on a write, turned into the two errors a caller can act on.

* ``BrokerUnavailableError``: the broker did not answer (connection refused, timeout): the write
  may or may not have happened, so the caller checks and retries (``send`` retries elsewhere).
* ``BrokerRefusedError``: the broker answered and refused the write before the script stored
  anything (out of memory, MISCONF, READONLY...): nothing was written.

Anything else (a bug, a script error) is re-raised as it is.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from mqorder.errors import BrokerRefusedError, BrokerUnavailableError, ConfigError, TopicNotFoundError

#: The error a script gives for a write to a deleted topic's queue (``refuse_if_gone`` in
#: ``_append.lua``, ``mqorder.keys.queue_gone``).
TOPIC_DELETED = "MQORDER_TOPIC_DELETED"

#: Errors after which the broker may come back: the caller may retry.
#: On a Redis Cluster also a failover or migration still settling (CLUSTERDOWN, TRYAGAIN) and no
#: node answering at all (redis-py's ``RedisClusterException``, which is not a ``RedisError``).
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
             redis.exceptions.TryAgainError, redis.exceptions.RedisClusterException)
#: Every error a Redis call raises (a cluster client's ``RedisClusterException`` is not a ``RedisError``).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)
#: How Redis refuses a write before a script stored anything (a script's first command is a
#: write, and these refusals apply to every write alike): redis-py's classes for the codes it
#: knows (OOM, READONLY, NOPERM, MASTERDOWN), the text for those it does not.
_REFUSAL_CLASSES = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    redis.exceptions.MasterDownError,
)
_REFUSAL_PREFIXES = ("MISCONF", "NOREPLICAS", "BUSY ")


def setup_hint(exc: BaseException) -> str | None:
    """What to change when a Redis error says the URL reaches the wrong thing, not a Redis that is
    down: a wrong password, a database number the server does not have, a Sentinel's port given as
    a server's (or the reverse). Each of these once read "did not answer" or "start redis-server",
    which sent the reader to a server that was running. None: not one of those."""
    text = str(exc)
    tls = _tls_hint(exc, text)
    if tls is not None:
        return tls
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return ("that address answered, but not in Redis's protocol (an HTTP server, another service, a TLS "
                "port given as redis://): check the host and port, and use rediss:// for a TLS Redis")
    if isinstance(exc, redis.AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH", "invalid password")):
        return "Redis refused this client's credentials: fix the password (user:password@) in the URL"
    if "DB index is out of range" in text or text == "Invalid Database":
        return ("that Redis has no database with the URL's number (/N): use one below its `databases` "
                "setting (16 by default), e.g. redis://host:6379/0")
    if "unknown command" in text:
        if "'SENTINEL'" in text or "'sentinel'" in text:
            return ("that address is a Redis server, not a Sentinel: give the Sentinels' host:port in "
                    "redis+sentinel://host:port[,host:port...]/<master name>, or use redis://host:port for the server")
        return ("that address does not know a command a Redis server has: it may be a Redis Sentinel (use "
                "redis+sentinel://host:port/<master name>), a Redis older than 7.0, or one with the command renamed")
    return None


def _tls_hint(exc: BaseException, text: str) -> str | None:
    """What to change when the TLS handshake refused the server's certificate (redis-py raises a
    ``ConnectionError`` whose cause is ``ssl.SSLCertVerificationError``): the server runs, and
    "start redis-server" sent the reader to the wrong place. A self-signed or private CA is the
    usual case: the client must be told which CA to trust."""
    cause = exc.__cause__ or exc.__context__
    if not (isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text):
        return None
    if "mismatch" in text:  # "Hostname mismatch" / "IP address mismatch"
        return ("the TLS handshake failed: the server's certificate does not name the host of the URL; connect by "
                "a name the certificate holds (its subjectAltName), or add ?ssl_check_hostname=false to the "
                "rediss:// URL (testing only: anyone holding a certificate of that CA could answer)")
    return ("the TLS handshake failed: this client does not trust the server's certificate; name the CA that "
            "signed it in the rediss:// URL, ?ssl_ca_certs=/path/ca.pem (or ssl_cert_reqs=none, for testing "
            "only: no verification at all)")


def unavailable(broker_name: str, safe_url: str, exc: Exception, timeout: float, action: str = "send",
                write: bool = True, outcome: str | None = None) -> BrokerUnavailableError:
    """``write``: the call may have changed something (a send: "may or may not be stored");
    ``outcome`` says what instead, for a call that is not a send."""
    outcome = outcome or ("The message may or may not be stored" if write else "Nothing was changed")
    hint = setup_hint(exc)
    if hint is not None:
        # Refused at the connection's handshake: fixing the URL is what to do, not waiting.
        return BrokerRefusedError(f"{action} failed: Redis broker {broker_name!r} at {safe_url}: {hint} "
                                  f"({type(exc).__name__}: {exc})")
    what = f"did not answer within {timeout}s" if isinstance(exc, redis.TimeoutError) else "could not be reached"
    tls = ""
    if safe_url.startswith("rediss") and isinstance(exc, TRANSIENT):
        # A plain server never answers a TLS handshake: it read as Redis being down.
        tls = "; with rediss:// (TLS), a server without TLS never completes the handshake: use redis:// for it"
    return BrokerUnavailableError(
        f"{action} failed: Redis broker {broker_name!r} at {safe_url} {what} "
        f"({type(exc).__name__}: {exc}). {outcome}; check the broker and retry{tls}"
    )


def refused(broker_name: str, safe_url: str, exc: redis.ResponseError, action: str = "send") -> BrokerRefusedError | None:
    """A refusal Redis gives for any write as a clear error; None for anything else."""
    text = str(exc)
    if isinstance(exc, _REFUSAL_CLASSES):
        text = f"{getattr(exc, 'status_code', None) or type(exc).__name__} {text}"
    elif not text.startswith(_REFUSAL_PREFIXES):
        return None
    return BrokerRefusedError(
        f"{action} failed: Redis broker {broker_name!r} at {safe_url} refused the write, so nothing "
        f"was stored: {text[:300]}. Fix that Redis (its log says why), or point the producer at "
        "another broker"
    )


def partly_refused(broker_name: str, safe_url: str, exc: redis.ResponseError, stored: int, unknown: int,
                   action: str = "send") -> BrokerRefusedError | None:
    """``refused`` for a refusal among several calls: Redis judges each call of a round trip on
    arrival, so other calls of the batch were stored (``stored`` messages) or may have been
    (``unknown`` calls whose replies are not known). Said so: "nothing was stored" invited a
    resend of the whole batch, which stored those twice. None: not a refusal."""
    if refused(broker_name, safe_url, exc, action) is None:
        return None
    text = str(exc)
    if isinstance(exc, _REFUSAL_CLASSES):
        text = f"{getattr(exc, 'status_code', None) or type(exc).__name__} {text}"
    part = f"{stored} message(s) of the batch ARE stored" + (
        f", and {unknown} other call(s) in the same round trip may have been" if unknown else "")
    return BrokerRefusedError(
        f"{action} failed: Redis broker {broker_name!r} at {safe_url} refused a write of this batch: {text[:300]}. "
        f"Part of the batch is stored: {part}. Resending the whole batch stores those again unless its sends "
        "have dedup keys (dedup_keys=, or MQORDER_DEDUP_DERIVE=msg_id); fix that Redis (its log says why)"
    )


def translation(exc: BaseException, broker_name: str, safe_url: str, timeout: float,
                action: str = "send", write: bool = True, outcome: str | None = None) -> Exception | None:
    """What ``translated`` raises instead of ``exc`` (None: ``exc`` itself is raised).

    For a hot path that cannot afford a generator-based context manager per call (a trickle of
    single sends: entering and leaving ``translated`` cost ~14 µs of client CPU per send here):
    ``try: ... except Exception as exc: raise (translation(exc, ...) or exc) from ...``."""
    if isinstance(exc, TRANSIENT):
        return unavailable(broker_name, safe_url, exc, timeout, action, write, outcome)
    if isinstance(exc, redis.exceptions.InvalidResponse):  # not Redis at all: nothing was stored
        return BrokerRefusedError(f"{action} failed: broker {broker_name!r} at {safe_url}: {setup_hint(exc)} "
                                  f"({type(exc).__name__}: {exc})")
    if isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
        # Only a plain client sees these (a cluster client follows them): its URL names one node.
        return ConfigError(
            f"{action} failed: Redis broker {broker_name!r} at {safe_url} answered {type(exc).__name__[:-5].upper()} "
            f"({exc}): it is a node of a Redis Cluster, and a plain redis:// URL reaches only the slots it "
            "serves. Give mqorder the cluster's URL: redis+cluster://host:port[,host:port...]/"
        )
    if isinstance(exc, redis.ResponseError):
        text = str(exc)
        if TOPIC_DELETED in text:  # a pipeline's error reads "Command # 2 (...) of pipeline caused error: ..."
            queue = text.split(TOPIC_DELETED, 1)[1].split()[:1] or ["?"]
            return TopicNotFoundError(
                f"{action} failed: the topic was deleted (`mqorder topic delete`): its queue {queue[0]} refuses "
                "writes, nothing was stored. Create the topic again if it should exist (producers see a "
                "topic's deletion or creation within 30 s)")
        hint = setup_hint(exc)
        if hint is not None:
            return ConfigError(f"{action} failed: Redis broker {broker_name!r} at {safe_url}: {hint} ({exc})")
        return refused(broker_name, safe_url, exc, action)
    return None


@contextmanager
def translated(broker_name: str, safe_url: str, timeout: float, action: str = "send",
               write: bool = True) -> Iterator[None]:
    """Run a write (or, ``write=False``, a read); re-raise its Redis failure as
    ``BrokerUnavailableError``/``BrokerRefusedError``."""
    try:
        yield
    except Exception as exc:
        err = translation(exc, broker_name, safe_url, timeout, action, write)
        if err is None:
            raise
        raise err from exc
