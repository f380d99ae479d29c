"""The compiled helpers of the Spark readers, ``mqorder.spark._resp`` (``_resp.c``), or None.

``setup.py`` builds the extension as optional: where no C compiler was there at install time the
install went on without it, and ``resp_pages`` and ``headers`` do the same work with numpy and
Arrow (slower: see ``_resp.c``). Imported here once, for both.
"""

from __future__ import annotations

from types import ModuleType

_resp: ModuleType | None
try:
    import mqorder.spark._resp as _resp
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _resp = None
