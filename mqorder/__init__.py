"""mqorder: RocketMQ-style orderly message consumption for Python, on Celery and Redis.

::

    from mqorder import Producer, orderly_listener, ConsumeOrderlyStatus

    producer = Producer()
    producer.create_topic("orders", queues=8)
    producer.send_orderly("orders", body=b'{"order": 42}', sharding_key="42")

    @orderly_listener(topic="orders", group="billing")
    def on_order(msgs, ctx):
        return ConsumeOrderlyStatus.SUCCESS

This package's core (model, store, locks, allocation, ProcessQueue, engine) imports nothing from
Celery; ``mqorder.celery`` holds the Celery tasks and the worker bootstep.
"""

from mqorder.client.producer import Producer
from mqorder.client.pull_consumer import PullConsumer, PullResult, PullStatus
from mqorder.client.transaction import LocalTransactionState, TransactionProducer, TransactionSendResult
from mqorder.client.transaction_check import transaction_checker
from mqorder.consumer.context import ConsumeConcurrentlyContext, ConsumeOrderlyContext
from mqorder.consumer.hooks import ConsumeMessageContext, ConsumeMessageHook, register_consume_message_hook
from mqorder.consumer.listener import concurrent_listener, orderly_listener
from mqorder.errors import (
    BrokerFullError,
    BrokerRefusedError,
    BrokerUnavailableError,
    BufferExhaustedError,
    ConfigError,
    EvictionPolicyError,
    InvalidNameError,
    MessageError,
    MessageTooLargeError,
    MQOrderError,
    NotEnoughReplicasError,
    OffsetFencedError,
    OffsetIllegalError,
    ProducerClosedError,
    ReplicasBehindError,
    TopicNotFoundError,
    TopicNotWritableError,
    TransactionEndedError,
)
from mqorder.model import (
    ConsumeConcurrentlyStatus,
    ConsumeFromWhere,
    ConsumeOrderlyStatus,
    MessageExt,
    MessageModel,
    MessageQueue,
    SendResult,
    SendStatus,
)

__version__ = "0.1.0"

__all__ = [
    "BrokerFullError",
    "BrokerRefusedError",
    "BrokerUnavailableError",
    "BufferExhaustedError",
    "ConfigError",
    "EvictionPolicyError",
    "ConsumeConcurrentlyContext",
    "ConsumeConcurrentlyStatus",
    "ConsumeFromWhere",
    "ConsumeMessageContext",
    "ConsumeMessageHook",
    "ConsumeOrderlyContext",
    "ConsumeOrderlyStatus",
    "InvalidNameError",
    "LocalTransactionState",
    "MQOrderError",
    "MessageError",
    "MessageExt",
    "MessageModel",
    "MessageQueue",
    "MessageTooLargeError",
    "NotEnoughReplicasError",
    "OffsetFencedError",
    "OffsetIllegalError",
    "Producer",
    "ProducerClosedError",
    "PullConsumer",
    "PullResult",
    "PullStatus",
    "ReplicasBehindError",
    "SendResult",
    "SendStatus",
    "TopicNotFoundError",
    "TopicNotWritableError",
    "TransactionEndedError",
    "TransactionProducer",
    "TransactionSendResult",
    "concurrent_listener",
    "orderly_listener",
    "register_consume_message_hook",
    "transaction_checker",
]
