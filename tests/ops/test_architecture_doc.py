"""docs/architecture.md stays true: every file, folder and symbol it names exists in the tree.

What the page names, and how each is checked (all on CPU, by reading files; nothing is imported):

- a path in backticks or in the diagram (``engine/core.py``, ``serve/ingress.py``, ``actors/``):
  the file or folder exists at the repo root or under ``conflux_cluster/`` (the import namespace
  maps ``serve/`` there); a bare file name in the diagram (``ledger.py``) exists in a product folder;
- ``path/module.symbol`` (``engine/contracts/request.resolve_max_tokens``): the module defines or imports
  ``symbol`` at top level;
- ``Class`` and ``Class.member`` (``EngineCore``, ``RankWorker.execute``): a product module defines
  the class, with that method or field;
- ``conflux <command>``: ``conflux_cluster/commands/<command>.py`` exists;
- a bare ``name`` or ``name(...)`` (``abort(id)``, ``feed_client``): a product module, function,
  method or class of that name exists.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PRODUCT = ("engine", "actors", "router", "conflux_cluster")
# Where a relative path in the page may live: the repo root, or the conflux_cluster package.
PATH_BASES = (ROOT, ROOT / "conflux_cluster")
# Names the page uses that belong to Ray, not to this tree.
EXTERNAL = {"serve.shutdown()"}

_PATH = re.compile(r"^[\w.\-/]+\.(py|md|yaml|yml|json)$")
_FOLDER = re.compile(r"^[\w\-/]+/$")
_MODULE_SYMBOL = re.compile(r"^([\w/]+/\w+)\.(\w+)(\(.*\))?$")
_CLASS_MEMBER = re.compile(r"^([A-Z]\w*)(?:\.(\w+))?(\(.*\))?$")
_NAME = re.compile(r"^(\w+)(\(.*\))?$")


@lru_cache(maxsize=1)
def _index() -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(class name -> its members, every def/class/module name, every product file name)."""
    classes: dict[str, set[str]] = {}
    names: set[str] = set()
    files: set[str] = set()
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            files.add(path.name)
            names.add(path.stem)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.ClassDef):
                    names.add(node.name)
                    classes.setdefault(node.name, set()).update(_members(node))
    return classes, names, files


def _members(node: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.Assign):
            out.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return out


def _top_level(path: Path) -> set[str]:
    """Names a module defines, assigns or imports at top level."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def _find(rel: str) -> Path | None:
    for base in PATH_BASES:
        if (base / rel).exists():
            return base / rel
    return None


def _problem(token: str) -> str | None:
    """Why ``token`` does not name something in the tree, or None when it does."""
    classes, names, files = _index()
    if token in EXTERNAL:
        return None
    if token.startswith("conflux "):
        command = token.split()[1]
        return None if (ROOT / "conflux_cluster" / "commands" / f"{command}.py").exists() else f"no command {command}"
    if _PATH.match(token) or _FOLDER.match(token):
        if "/" not in token.rstrip("/") and token.endswith(".py"):
            return None if token in files else f"no product file named {token}"
        return None if _find(token) else f"no file or folder {token}"
    m = _MODULE_SYMBOL.match(token)
    if m:
        module = _find(m.group(1) + ".py")
        if module is None:
            return f"no module {m.group(1)}.py"
        return None if m.group(2) in _top_level(module) else f"{module.relative_to(ROOT)} has no {m.group(2)}"
    m = _CLASS_MEMBER.match(token)
    if m:
        if m.group(1) not in classes:
            return f"no class {m.group(1)}"
        if m.group(2) and m.group(2) not in classes[m.group(1)]:
            return f"class {m.group(1)} has no {m.group(2)}"
        return None
    m = _NAME.match(token)
    if m:
        return None if m.group(1) in names else f"no module, function or class named {m.group(1)}"
    return f"cannot read {token!r} as a path or symbol"


def _named() -> set[str]:
    """Backticked tokens in the prose, plus paths and Class.member names drawn in the diagram."""
    text = DOC.read_text(encoding="utf-8")
    fences = re.findall(r"```.*?\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    tokens = set(re.findall(r"`([^`\n]+)`", prose))
    for block in fences:
        tokens.update(re.findall(r"[\w/]+/[\w.]+\.py|\b\w+\.py\b", block))
        tokens.update(re.findall(r"\b[A-Z][a-z]\w*\.[a-z_]\w*", block))
        tokens.update(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", block))
    return tokens


def test_every_path_and_symbol_named_in_architecture_doc_exists():
    tokens = _named()
    assert len(tokens) > 20, "the parser found almost nothing in docs/architecture.md"
    problems = {t: why for t in sorted(tokens) if (why := _problem(t))}
    assert not problems, "docs/architecture.md names things that are not in the tree:\n" + "\n".join(
        f"  `{t}`: {why}" for t, why in problems.items())


def test_checker_rejects_missing_names():
    # The check can fail: names that do not exist are reported, names that do are not.
    assert _problem("engine/no_such_module.py")
    assert _problem("engine/core.no_such_function")
    assert _problem("EngineCore.no_such_method")
    assert _problem("NoSuchClassAnywhere")
    assert _problem("engine/core.py") is None
    assert _problem("EngineCore") is None
    assert _problem("conflux no-such-command")
    assert _problem("conflux serve") is None


# Date-shaped text a product file may hold: examples of the timestamp formats a trace can carry.
DATE_EXAMPLES = {"2023-11-16"}


def test_product_code_carries_no_dates():
    """The history of runs lives in docs/results/LOG.md; a code comment says what is true now."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    found = [f"{path.relative_to(ROOT)}: {d}" for top in PRODUCT for path in sorted((ROOT / top).rglob("*.py"))
             for d in date.findall(path.read_text(encoding="utf-8")) if d not in DATE_EXAMPLES]
    assert not found, found
