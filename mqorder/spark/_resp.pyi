"""Types of the compiled ``mqorder.spark._resp`` (``_resp.c``; ``mqorder.spark.native`` imports it)."""

from typing import Any

def cut_spans(data: Any, first: int, end: int, n: int, fields: bytes, out: Any, /) -> bool:
    """Whether ``data[first:end]`` is exactly ``n`` XRANGE entries of ``fields``; their ranges in ``out``."""

def gather(data: Any, starts: Any, ends: Any, /) -> tuple[bytes, bytes]:
    """The ranges of ``data`` as an Arrow binary array's (int32 offsets, values) buffers."""

def parse_template(data: Any, offsets: Any, n: int, segments: tuple[bytes, ...], kinds: bytes, spans: Any,
                   ints: Any, /) -> bool:
    """Whether the ``n`` records are ``segments`` around values of ``kinds``; ranges in ``spans``, integers in ``ints``."""
