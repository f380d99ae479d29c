"""Types of the compiled ``mqorder.spark._resp`` (``_resp.c``)."""

from typing import Any

def cut_spans(data: Any, first: int, end: int, n: int, fields: bytes, out: Any, /) -> bool:
    """Whether ``data[first:end]`` is exactly ``n`` XRANGE entries of ``fields``; their ranges in ``out``."""
