"""Types of the compiled ``mqorder.store._pack`` (``_pack.c``; ``mqorder.store.packing`` imports it)."""

from collections.abc import Callable, Sequence
from typing import Any

def pack_commands(commands: Sequence[Any], fallback: Callable[[Any], bytes], /) -> bytes:
    """Every command (a tuple of arguments, or bytes packed already) as RESP, in order; a tuple this
    packer does not take goes to ``fallback(cmd)``, whose bytes or error stand."""
