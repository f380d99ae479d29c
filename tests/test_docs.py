"""The docs site's promises that a build alone does not check (issue 24).

- Every "invariant N" the code cites (``mqorder/**/*.py``, ``*.lua``) has its text in
  docs/ARCHITECTURE.md under the anchor ``#invariant-N``, and the page numbers them 1..10 once each.
- The generated parts fail loudly: a setting without a doc and a Lua script without a header stop
  the build (docs/hooks.py), and today's settings and scripts all have one.
- The API index links every name ``mqorder`` exports.
- The README stays a front door: at most ~200 lines, and its first commands are ``make test`` and
  ``make demo``.
- No page, README or report carries an absolute path of the machine that produced it.

``mkdocs build --strict`` itself runs in ``make test`` (links, anchors, API references).
"""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

import mqorder
from tests.support import ROOT

ARCH = ROOT / "docs" / "ARCHITECTURE.md"
CITED = re.compile(r"\binvariant (\d+)\b", re.I)
ANCHOR = re.compile(r"\{#invariant-(\d+)\}")
#: An absolute path of a machine: a home, a scratch or a checkout directory.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|Users)/")


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mqorder_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cited_invariants() -> dict[int, list[str]]:
    """Each invariant number cited in the package's code and scripts, with where."""
    found: dict[int, list[str]] = {}
    for path in sorted((ROOT / "mqorder").rglob("*")):
        if path.suffix not in (".py", ".lua") or "__pycache__" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in CITED.finditer(line):
                found.setdefault(int(m.group(1)), []).append(f"{path.relative_to(ROOT)}:{n}")
    return found


def test_every_cited_invariant_has_its_text() -> None:
    cited = cited_invariants()
    assert cited, "no 'invariant N' found in mqorder/: the scan is broken"
    anchors = [int(n) for n in ANCHOR.findall(ARCH.read_text())]
    missing = {n: where for n, where in cited.items() if n not in anchors}
    assert not missing, f"invariants cited but not in docs/ARCHITECTURE.md (add '{{#invariant-N}}'): {missing}"


def test_architecture_numbers_the_invariants_once_each() -> None:
    anchors = [int(n) for n in ANCHOR.findall(ARCH.read_text())]
    assert anchors == list(range(1, 11)), anchors


def test_every_setting_is_documented_and_the_table_names_each() -> None:
    from mqorder.settings import Settings

    table = _hooks().settings_table()
    for name in Settings.model_fields:
        assert f"| `MQORDER_{name.upper()}` |" in table, name


def test_a_setting_without_a_doc_fails_the_build() -> None:
    hooks = _hooks()

    class Demo(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="DEMO_")

        #: Documented above.
        above: int = Field(1, ge=1)
        trailing: float = 2.0  # documented on its line
        described: str = Field("x", description="documented by Field")
        bare: int = 3

    source = '''
class Settings:
    #: Documented above.
    above: int = Field(1, ge=1)
    trailing: float = 2.0  # documented on its line
    described: str = Field("x", description="documented by Field")
    bare: int = 3
'''
    with pytest.raises(hooks.PluginError, match=r"no doc for the setting\(s\) bare\b"):
        hooks.settings_table(Demo, source)
    del Demo.model_fields["bare"]
    table = hooks.settings_table(Demo, source)
    assert "| `DEMO_ABOVE` | `int` | `1` | ≥ 1 | Documented above. |" in table
    assert "documented on its line" in table and "documented by Field" in table


def test_every_lua_script_has_a_header() -> None:
    table = _hooks().lua_table()
    for path in (ROOT / "mqorder" / "store" / "lua").glob("*.lua"):
        row = next((r for r in table.splitlines() if r.startswith(f"| `{path.name}` |")), None)
        assert row and len(row) > len(path.name) + 20, f"{path.name}: no header text in {row!r}"


def test_api_index_links_every_export() -> None:
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    for name in mqorder.__all__:
        obj = getattr(mqorder, name)
        assert f"[`{name}`][{obj.__module__}.{name}]" in index, f"{name} is exported but not in docs/api/index.md"


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first_block = re.search(r"```\w*\n(.*?)```", text, re.S)
    assert first_block and first_block.group(1).split("\n") == ["make test", "make demo", ""]


@pytest.mark.parametrize("path", ["README.md", "CHANGELOG.md", "bench/RESULTS.md",
                                  *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
def test_no_absolute_machine_path(path: str) -> None:
    hits = [f"{n}: {line.strip()[:120]}" for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
            if MACHINE_PATH.search(line)]
    assert not hits, f"{path} names paths of the machine that wrote it: {hits}"


def test_readme_links_resolve() -> None:
    """The README is read on a forge, not in the site: its relative links must name files that exist."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [t for t in targets if "://" not in t]
    assert local, "no relative link found in README.md: the scan is broken"
    assert not [t for t in local if not (ROOT / t).exists()]
