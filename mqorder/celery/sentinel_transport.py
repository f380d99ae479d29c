"""kombu's Sentinel transport with mqorder's demotion-aware connections.

kombu's ``SentinelChannel`` connects with redis-py's ``SentinelManagedConnection``, which turns a
READONLY reply (a demoted primary) into a ``ConnectionError`` that kombu recovers from. An old
primary resumed after a failover answers NOREPLICAS instead (with ``min-replicas-to-write``), until
Sentinel demotes it; kombu takes that ``ResponseError`` for an unrecoverable error and the worker
exits. This transport's channel uses ``mqorder.store.connect.DemotionAwareConnection``, so the
BRPOP that gets NOREPLICAS reconnects to the primary the Sentinels name now. Celery is pointed at
it by ``broker_transport`` (``mqorder.celery.broker``), the broker URL staying kombu's
``sentinel://`` list.
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from mqorder.store.connect import DemotionAware, DemotionAwareConnection

#: What ``broker_transport`` names (kombu resolves ``module:Class``).
TRANSPORT = "mqorder.celery.sentinel_transport:SentinelTransport"


class DemotionAwareKombuSSLConnection(DemotionAware, kombu_redis.SentinelManagedSSLConnection):
    """kombu's own TLS Sentinel connection (``rediss+sentinel://`` brokers), demotion-aware."""


class SentinelChannel(kombu_redis.SentinelChannel):
    connection_class = DemotionAwareConnection
    connection_class_ssl = DemotionAwareKombuSSLConnection


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
