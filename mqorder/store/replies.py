"""Redis replies as Python strings.

mqorder's clients never set ``decode_responses`` (bodies are bytes and must stay bytes), so every
textual reply arrives as ``bytes``; redis-py's type hints say ``bytes | str``. One helper decodes
both, so neither a reply nor the type checker is guessed at in each module.
"""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """A reply field as ``str`` (UTF-8); ``None`` becomes ``""``.

    Plain ``bytes`` first, without a copy: nearly every reply is one, and this runs several times
    per message on the consume path (the union ``bytes | bytearray | memoryview`` was built anew
    and a copy made at every call)."""
    if type(value) is bytes:
        return value.decode()
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode()
    return str(value)
