"""Producer idempotence: the dedup key of a send, and the result a deduplicated resend returns.

A send with a dedup key is stored at most once per queue within the dedup window
(``MQORDER_DEDUP_WINDOW_MS``, 5 minutes like SQS FIFO): ``append_entries`` checks and records the key
in the same Lua step that appends, so two racing sends of one key, or a timed-out attempt that
Redis runs *after* its retry, store one message. That is what makes the producer's own retries
safe: without a key, an attempt that timed out but was stored anyway and then retried is stored
twice, and an attempt delayed in a socket buffer can land after the next message (a reorder).

The key is given per send (``dedup_key=``) or derived (``MQORDER_DEDUP_DERIVE``): the send's own
message id (retries are deduplicated, resends by the application are not) or the body's SHA-256
(SQS's content-based deduplication: an identical body within the window is dropped).
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

from mqorder.errors import MessageError
from mqorder.model import MessageQueue, SendResult, SendStatus
from mqorder.store.log import MessageLog

#: SQS's limit for MessageDeduplicationId; a key is an id, not a payload.
MAX_DEDUP_KEY_LEN = 128


def check_dedup_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise MessageError(f"dedup_key must be a non-empty str (e.g. the order event's id), got {key!r}"[:200])
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Found only when the round trip was packed: a batch's every other send failed with it.
        raise MessageError(f"dedup_key is not valid UTF-8 text ({exc.reason} at {exc.start}): {key!r}"[:200]) from None
    if len(key) > MAX_DEDUP_KEY_LEN:
        raise MessageError(
            f"dedup_key is {len(key)} characters, over {MAX_DEDUP_KEY_LEN}; use a hash of it (e.g. its SHA-256 hex)"
        )
    return key


class DedupDerive(StrEnum):
    """``MQORDER_DEDUP_DERIVE``: the dedup key of a send that names none."""

    #: No key: only ``dedup_key=`` deduplicates.
    NONE = "none"
    #: The send's own message id: the producer's retries never duplicate, the application's resends may.
    MSG_ID = "msg_id"
    #: The body's SHA-256 (SQS's content-based deduplication).
    CONTENT = "content"


def dedup_key_of(given: object, derive: DedupDerive, msg_id: str, body: bytes) -> str | None:
    """The key a send is deduplicated by, or None when it is not (``derive`` = ``none``, no key)."""
    if given is not None:
        return check_dedup_key(given)
    if derive == DedupDerive.MSG_ID:
        return msg_id
    if derive == DedupDerive.CONTENT:
        return hashlib.sha256(body).hexdigest()
    return None


def first_send_result(log: MessageLog, mq: MessageQueue, offset: int) -> SendResult:
    """The ``SendResult`` of the send that first stored ``offset``, read back from the log.

    The entry at an offset never changes, so reading it after the deduplicating append is as good
    as reading it in that step. If retention already trimmed it (a window longer than the
    retention), the id and store time are unknown: ``msg_id`` is ``""`` and the time 0.
    """
    got = log.read(mq, offset, 1)
    if got and got[0].queue_offset == offset:
        return SendResult(SendStatus.SEND_OK, got[0].msg_id, mq, offset, got[0].store_timestamp)
    return SendResult(SendStatus.SEND_OK, "", mq, offset, 0)
