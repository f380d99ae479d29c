"""Celery settings that depend on Celery's own broker: Redis or RabbitMQ.

Celery's broker carries only mqorder's tasks (``consume_request`` to one worker's direct queue,
``rebalance`` and ``lock_all`` to the default queue); messages, locks and offsets stay in Redis
whatever it is. What each broker needs:

* **Redis** (kombu's virtual transport): a fetched but unacknowledged message, such as an ETA
  task waiting out its countdown in worker memory, is redelivered after ``visibility_timeout``.
  Countdowns here are seconds (suspend-and-requeue), so an hour is far above any of them and a
  countdown task is never handed out twice. ``ack_emulation`` stays the application's choice
  (the stock workers turn it off: ``mqorder.celery.stock_config``).
* **RabbitMQ** (py-amqp): acks, redelivery and per-worker queues are the broker's own. A
  delivered but unacked message goes back to its queue when the worker's connection closes
  (warm shutdown, ``kill -9``, a dropped link), so no visibility timeout exists and none is set;
  a Redis transport option would mean nothing there. Worker-direct queues are durable queues on
  the ``C.dq2`` direct exchange, declared by the worker and again by every publish to them, so a
  ConsumeRequest sent to a worker that is still starting is kept, not dropped as unroutable.
  ETA tasks are held unacked in the worker (Celery raises the channel's prefetch for each);
  RabbitMQ closes a channel holding a delivery unacked past ``consumer_timeout`` (30 min by
  default), again far above mqorder's countdowns (at most ``suspend_current_queue_time_millis``,
  30 s). ``consume_request`` is acked when it starts (``acks_late=False``): a request that dies
  mid-run is not redelivered, it is replaced by the sweep, because its progress and its claim
  live in Redis and a redelivered copy would only be refused as stale.
* **Redis under Sentinel** (kombu's ``sentinel://`` transport, a flavour of the Redis one: the
  options above apply). With the store on ``redis+sentinel://`` and no
  ``MQORDER_CELERY_BROKER_URL``, Celery's broker is the same deployment through kombu:
  ``sentinel://[:pw@]h1:26379/<db>;sentinel://[:pw@]h2:26380/<db>`` (kombu asks each in turn; the
  first URL's credentials and db are the data nodes'), with ``master_name`` and, for the
  Sentinels' own password, ``sentinel_kwargs`` in ``broker_transport_options`` (kombu's
  ``SentinelChannel`` passes them to ``redis.sentinel.Sentinel``). kombu's connection then follows
  a failover like the store's client does (each new connection asks the Sentinels). An explicit
  ``MQORDER_CELERY_BROKER_URL`` may be either form; kombu's needs ``MQORDER_CELERY_SENTINEL_MASTER``.
* **Never a Redis Cluster**: kombu has no cluster transport (``mqorder.store.brokers.
  cluster_celery_broker_error`` says why). A ``redis+cluster://`` store with no
  ``MQORDER_CELERY_BROKER_URL`` would make the cluster Celery's broker too, so :func:`celery_broker`
  refuses it when the app is configured (``install``, the stock workers' config), naming the
  brokers that work; the store itself stays on the cluster.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any

from mqorder.errors import ConfigError
from mqorder.store.brokers import celery_transport, cluster_celery_broker_error, is_kombu_sentinel_url, redact_url
from mqorder.store.cluster_urls import is_cluster_url
from mqorder.store.connect import sentinel_credentials
from mqorder.store.urls import SentinelURL, host_port, is_sentinel_url, parse_sentinel_url

#: Far above any countdown mqorder uses; see the module docstring.
REDIS_VISIBILITY_TIMEOUT = 3600
#: Celery's ``broker_transport`` for a Sentinel broker: kombu's Sentinel transport whose
#: connections take an old primary's NOREPLICAS for a failover (``mqorder.celery.sentinel_transport``).
SENTINEL_TRANSPORT = "mqorder.celery.sentinel_transport:SentinelTransport"


@dataclass(frozen=True)
class CeleryBroker:
    """What Celery is given for its broker: the URL kombu understands, the transport options that
    URL needs (the Sentinel master and password), and ``broker_use_ssl`` (``None``: leave it)."""

    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    use_ssl: dict[str, Any] | None = None
    #: ``broker_transport`` (``None``: the URL's scheme decides).
    transport: str | None = None


def kombu_sentinel_url(parsed: SentinelURL) -> str:
    """kombu's ``sentinel://`` list for a parsed ``redis+sentinel://`` URL: one URL per Sentinel,
    each with the data nodes' credentials and db (kombu reads them from the first)."""
    return ";".join(f"sentinel://{parsed.userinfo}{host_port(h, p)}/{parsed.db}" for h, p in parsed.sentinels)


#: How :func:`celery_broker`'s refusal names a broker derived from the store's URL.
DERIVED_FROM_STORE = "MQORDER_REDIS_URL (Celery's broker, since MQORDER_CELERY_BROKER_URL is unset)"


def celery_broker(url: str, *, sentinel_master: str | None = None, sentinel_password: str | None = None,
                  what: str = "Celery's broker") -> CeleryBroker:
    """Celery's broker for ``url`` (``MQORDER_CELERY_BROKER_URL``, else the store's URL).

    ``redis+sentinel://`` becomes kombu's ``sentinel://`` list with ``master_name`` and the
    Sentinels' credentials as transport options; kombu's own ``sentinel://`` gets ``master_name``
    from ``sentinel_master`` (``MQORDER_CELERY_SENTINEL_MASTER``) and the Sentinels' password
    from ``sentinel_password`` (``MQORDER_SENTINEL_PASSWORD``); any other URL is Celery's as is.
    ``ConfigError`` for a Redis Cluster URL: the store may be one, Celery's broker may not; ``what``
    names where the URL came from (``DERIVED_FROM_STORE``, the usual way here).
    """
    if is_cluster_url(url):
        raise cluster_celery_broker_error(url, what)
    if is_sentinel_url(url):
        parsed = parse_sentinel_url(url, sentinel_password=sentinel_password)
        options: dict[str, Any] = {
            "master_name": parsed.master_name,
            "sentinel_kwargs": sentinel_credentials(parsed.sentinel_password, parsed.sentinel_username),
        }
        if parsed.socket_timeout is not None:
            options["socket_timeout"] = parsed.socket_timeout
        if parsed.socket_connect_timeout is not None:
            options["socket_connect_timeout"] = parsed.socket_connect_timeout
        use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED} if parsed.ssl else None
        return CeleryBroker(kombu_sentinel_url(parsed), options, use_ssl, SENTINEL_TRANSPORT)
    if is_kombu_sentinel_url(url):
        options = {"sentinel_kwargs": sentinel_credentials(sentinel_password, None)}
        if sentinel_master:
            options["master_name"] = sentinel_master
        return CeleryBroker(url, options, transport=SENTINEL_TRANSPORT)
    return CeleryBroker(url)


def transport_options(broker_url: str, app_options: dict[str, Any] | None) -> dict[str, Any]:
    """``broker_transport_options`` for ``broker_url``: mqorder's defaults for that broker kind,
    under the application's own options (which win). ``ConfigError`` for a ``sentinel://`` broker
    with no ``master_name``: kombu would fail only at the first connection, inside the worker."""
    ours: dict[str, Any] = {}
    if celery_transport(broker_url) == "redis":
        ours["visibility_timeout"] = REDIS_VISIBILITY_TIMEOUT
    out = {**ours, **(app_options or {})}
    if is_kombu_sentinel_url(broker_url) and not out.get("master_name"):
        raise ConfigError(
            f"Celery's broker {redact_url(broker_url)!r} is Redis Sentinel, but no master name is set: "
            "set MQORDER_CELERY_SENTINEL_MASTER=<master-name> (or broker_transport_options['master_name']), "
            "or write the URL as redis+sentinel://host:port,host:port/<master-name>"
        )
    return out
