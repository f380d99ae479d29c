"""A round trip's commands packed as RESP: ``pack_commands``, compiled where it could be built.

At a trickle a worker's round trip is four or five commands and about 60 arguments per message,
most of them the same keys, tokens and settings message after message. Packed one command at a
time with ``hiredis.pack_command`` (an sds copy per argument, an int's repr through Python, each
length formatted with ``sprintf``), that was 16 % of a trickling worker's instructions. The
optional extension ``mqorder.store._pack`` packs the whole round trip in one call into one buffer
(its source says how); it gives hiredis's bytes exactly (``tests/test_pack.py``) and hands any
command it does not take (a memoryview, a subclass of str, bytes or int, a bool, a bad type) to
hiredis, whose bytes or error stand. (An int too long to spell, or a float whose repr raises,
raises here; hiredis crashes on both.) Without a C compiler at install time, hiredis packs
everything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hiredis

_compiled: Callable[[Sequence[Any], Callable[[Any], bytes]], bytes] | None
try:
    from mqorder.store._pack import pack_commands as _compiled
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _compiled = None

_hiredis_pack = hiredis.pack_command

#: Whether the compiled packer is in use (``tests/test_pack.py`` holds that ``make install`` builds it).
COMPILED = _compiled is not None


def pack_commands_hiredis(commands: Sequence[Any]) -> bytes:
    """Every command packed by hiredis, in order (a ``bytes`` command is packed already)."""
    return b"".join([c if type(c) is bytes else _hiredis_pack(c) for c in commands])


if _compiled is not None:
    _packer = _compiled

    def pack_commands(commands: Sequence[Any]) -> bytes:
        """Every command (a tuple of arguments, or ``bytes`` packed already) as RESP, in order."""
        return _packer(commands, _hiredis_pack)
else:  # pragma: no cover - exercised where the extension is not built
    pack_commands = pack_commands_hiredis


def pack_command(args: tuple[Any, ...]) -> bytes:
    """One command as RESP (``hiredis.pack_command``'s bytes and errors: anything but a tuple,
    bytes included, is refused as hiredis refuses it)."""
    if type(args) is not tuple:
        return _hiredis_pack(args)
    return pack_commands((args,))
