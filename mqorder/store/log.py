"""Read access to queue logs and consume offsets (admin, demo, tests, the ordering audit).

The hot consume path does not use this module: it reads through the fused begin/commit scripts.
"""

from __future__ import annotations

from mqorder import keys
from mqorder.codec import decode_entries
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.brokers import BrokerRegistry


class MessageLog:
    def __init__(self, brokers: BrokerRegistry) -> None:
        self.brokers = brokers

    def _client(self, mq: MessageQueue):
        return self.brokers.get(mq.broker_name).client

    def max_offset(self, mq: MessageQueue) -> int:
        """The next offset to be written (RocketMQ's maxOffset): the log holds [min, max)."""
        return int(self._client(mq).get(keys.queue_next(mq.tag)) or 0)

    def min_offset(self, mq: MessageQueue) -> int:
        first = self._client(mq).xrange(keys.queue_log(mq.tag), count=1)
        if not first:
            return self.max_offset(mq)
        return int(first[0][0].split(b"-", 1)[0])

    def read(self, mq: MessageQueue, offset: int, count: int) -> list[MessageExt]:
        entries = self._client(mq).xrange(keys.queue_log(mq.tag), min=str(offset), count=count)
        return decode_entries(mq, entries)

    def consume_offset(self, sub: str, mq: MessageQueue) -> int:
        raw = self._client(mq).hget(keys.sub_state(mq.tag, sub), "offset")
        return int(raw or 0)

    def lag(self, sub: str, mq: MessageQueue) -> int:
        return self.max_offset(mq) - self.consume_offset(sub, mq)

    def state(self, sub: str, mq: MessageQueue) -> dict[str, str]:
        raw = self._client(mq).hgetall(keys.sub_state(mq.tag, sub))
        return {k.decode(): v.decode() for k, v in raw.items()}
