"""MkDocs hooks of the mqorder docs site: the parts of the site that are generated, so they cannot drift.

- ``SETTINGS.md``: the ``<!-- mqorder:settings -->`` marker becomes a table of every field of
  ``mqorder.settings.Settings`` (environment variable, type, default, constraints, doc). The doc is
  the field's ``Field(description=...)`` or the ``#:`` comment lines above it (a trailing ``#``
  comment as a last resort); a field with none fails the build, so a new setting cannot ship
  undocumented.
- ``ARCHITECTURE.md``: the ``<!-- mqorder:lua-scripts -->`` marker becomes the list of the Lua
  scripts of ``mqorder/store/lua``, each with the first paragraph of its header comment; a script
  without a header fails the build.
- ``RESULTS.md`` and ``CHANGELOG.md``: ``bench/RESULTS.md`` (where ``bench/report.py`` writes it)
  and the repository's ``CHANGELOG.md`` are added to the site as they are.
- API pages: "invariant N" in rendered docstrings links to ``ARCHITECTURE.md#invariant-N``.

Everything is read from the working tree at build time; nothing is fetched.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_PY = ROOT / "mqorder" / "settings.py"
LUA_DIR = ROOT / "mqorder" / "store" / "lua"
SETTINGS_MARK = "<!-- mqorder:settings -->"
LUA_MARK = "<!-- mqorder:lua-scripts -->"
#: Files outside docs/ that the site shows as pages: (source in the repository, page path in the site).
INCLUDED = ((ROOT / "bench" / "RESULTS.md", "RESULTS.md"), (ROOT / "CHANGELOG.md", "CHANGELOG.md"))
_CONSTRAINTS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "length ≥"),
                ("max_length", "length ≤"), ("pattern", "matches"))


def _rst_to_md(text: str) -> str:
    """Docstring-style ``literals`` as Markdown `literals`, and no line breaks (a table cell)."""
    return re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def field_docs(source: str) -> dict[str, dict[str, Any]]:
    """Per field of ``class Settings`` in ``source``: its annotation and the comments that document it.

    Returns ``{name: {"type": str, "doc": str, "trailing": str}}``: ``doc`` is the block of ``#:``
    lines right above the field, ``trailing`` a ``#`` comment on the field's own lines.
    """
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings"), None)
    if cls is None:
        raise PluginError(f"{SETTINGS_PY}: no class Settings to document")
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    out: dict[str, dict[str, Any]] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        i = stmt.lineno - 1  # 1-based line numbers: lines[i - 1] is the line above the field
        while i >= 1 and lines[i - 1].strip().startswith("#:"):
            above.insert(0, lines[i - 1].strip()[2:].strip())
            i -= 1
        trailing = [comments[n].lstrip("#").strip() for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                    if n in comments and not lines[n - 1].strip().startswith("#")]
        out[stmt.target.id] = {"type": ast.unparse(stmt.annotation), "doc": " ".join(above),
                               "trailing": " ".join(trailing)}
    return out


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value == "" or value == {} or value == []:
        return "empty"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"`{value:_}`"
    return f"`{value}`"


def _constraints(field: Any) -> str:
    found = []
    for meta in field.metadata:
        for attr, sign in _CONSTRAINTS:
            bound = getattr(meta, attr, None)
            if bound is not None:
                found.append(f"{sign} {bound:_}" if isinstance(bound, int | float) else f"{sign} `{bound}`")
    return ", ".join(found)


def settings_table(model: Any = None, source: str | None = None) -> str:
    """The Markdown table of every field of ``model`` (``Settings``), documented from ``source`` (its
    module's text); raises ``PluginError`` naming each field without a doc."""
    if model is None:
        from mqorder.settings import Settings as model
    docs = field_docs(SETTINGS_PY.read_text() if source is None else source)
    rows = ["| variable | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    missing = []
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        info = docs.get(name, {"type": str(field.annotation), "doc": "", "trailing": ""})
        doc = field.description or info["doc"] or info["trailing"]
        if not doc:
            missing.append(name)
            continue
        var = (field.alias or f"{prefix}{name}").upper()
        rows.append("| " + " | ".join(_cell(c) for c in (
            f"`{var}`", f"`{info['type']}`", _default(field), _constraints(field), _rst_to_md(doc))) + " |")
    if missing:
        raise PluginError(
            f"{SETTINGS_PY.relative_to(ROOT)}: no doc for the setting(s) {', '.join(missing)}: add a `#:` comment "
            "above each field (or Field(description=...)) saying what it does and in which unit")
    return "\n".join(rows) + "\n"


def lua_header(path: Path) -> str:
    """The first paragraph of a script's leading ``--`` comment, without the ``name.lua:`` prefix."""
    para: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("--"):
            break
        if re.match(r"---\s*@include\b", line):  # an include directive (store/scripts.py), not prose
            continue
        text = line[2:].strip()
        if not text:
            if para:
                break
            continue
        para.append(text)
    return re.sub(rf"^{re.escape(path.name)}:\s*", "", " ".join(para))


def lua_table() -> str:
    """The table of the Lua scripts; raises ``PluginError`` naming each script without a header."""
    scripts = sorted(LUA_DIR.glob("*.lua"), key=lambda p: (not p.name.startswith("_"), p.name))
    if not scripts:
        raise PluginError(f"no Lua scripts in {LUA_DIR.relative_to(ROOT)}")
    rows = ["| script | what it does |", "|---|---|"]
    missing = []
    for path in scripts:
        text = lua_header(path)
        if not text:
            missing.append(path.name)
        rows.append(f"| `{path.name}` | {_cell(text)} |")
    if missing:
        raise PluginError(f"Lua scripts without a header comment: {', '.join(missing)}: say what each one does "
                          "in '--' lines at its top")
    return "\n".join(rows) + "\n"


def on_files(files: Files, config: Any) -> Files:
    for source, page in INCLUDED:
        if not source.exists():
            raise PluginError(f"{source.relative_to(ROOT)} is missing: the site shows it as {page}")
        files.append(File.generated(config, page, content=source.read_text()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    src = page.file.src_uri
    if src == "SETTINGS.md":
        if SETTINGS_MARK not in markdown:
            raise PluginError(f"docs/SETTINGS.md lost its {SETTINGS_MARK} marker")
        markdown = markdown.replace(SETTINGS_MARK, settings_table())
    if src == "ARCHITECTURE.md":
        if LUA_MARK not in markdown:
            raise PluginError(f"docs/ARCHITECTURE.md lost its {LUA_MARK} marker")
        markdown = markdown.replace(LUA_MARK, lua_table())
    return markdown


_INVARIANT = re.compile(r"(?<![\w-])(invariant) (\d+)(?!\d)", re.I)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """In the API pages, link each "invariant N" of a docstring to its text in ARCHITECTURE.md."""
    if not page.file.src_uri.startswith("api/"):
        return html
    arch = files.get_file_from_path("ARCHITECTURE.md")
    if arch is None:
        return html
    href = get_relative_url(arch.url, page.url)
    # Docstrings introduce literal blocks the reStructuredText way ("text::"); Markdown already shows
    # the indented block as code, so the marker goes: a lone "::" paragraph, or "::" ending one, as ":".
    html = re.sub(r"<p>::</p>\s*", "", html).replace("::</p>", ":</p>")
    # Only text between tags, and not inside a link or a code span already.
    parts = re.split(r"(<[^>]+>)", html)
    depth = 0
    for i, part in enumerate(parts):
        if part.startswith("<"):
            tag = re.match(r"</?(\w+)", part)
            if tag and tag.group(1).lower() in ("a", "code"):
                depth += -1 if part.startswith("</") else 1
            continue
        if depth == 0:
            parts[i] = _INVARIANT.sub(lambda m: f'<a href="{href}#invariant-{m.group(2)}">{m.group(1)} {m.group(2)}</a>',
                                      part)
    return "".join(parts)
