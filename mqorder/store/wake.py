"""The wake-up message: "a queue of yours has new messages, here is its dispatch token".

The append path publishes it on ``mqorder:wake:<owner>`` (see ``wake_owners`` in ``_append.lua``)
when an idle queue gets a message; the owner's client turns it into a ConsumeRequest. Its format
is defined here and nowhere else: a JSON array ``[sub, queue key, token]``, so no name can break
the parse whatever characters the name rules allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson


@dataclass(frozen=True, slots=True)
class WakeUp:
    sub: str
    mq_key: str
    token: str

    def encode(self) -> bytes:
        return orjson.dumps([self.sub, self.mq_key, self.token])

    @classmethod
    def decode(cls, data: bytes | str) -> WakeUp:
        """Parse a payload; ``ValueError`` if it is not one (a stranger published on the channel)."""
        try:
            sub, mq_key, token = orjson.loads(data)
        except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"not a wake-up payload: {data[:100]!r}") from exc
        if not all(isinstance(v, str) for v in (sub, mq_key, token)):
            raise ValueError(f"not a wake-up payload: {data[:100]!r}")
        return cls(sub, mq_key, token)
