"""The engine depends on nothing above it: no module under engine/ imports the router, the instance
actors or the serving layer, and the cross-process contract module needs neither torch nor Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
UPWARD = ("conflux_cluster.router", "conflux_cluster.actors", "conflux_cluster.serve", "conflux_cluster.commands")


def _imports(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    package = ["conflux_cluster", "engine", *path.relative_to(ENGINE).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            out.append(".".join(base + ([node.module] if node.module else [])))
    return out


def test_engine_imports_nothing_from_router_actors_or_serve() -> None:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 30
    bad = [(str(f.relative_to(ENGINE)), m) for f in files for m in _imports(f)
           if m.startswith(UPWARD) or m.split(".")[0] in ("router", "actors")]
    assert not bad, bad


def test_contracts_need_neither_torch_nor_ray() -> None:
    code = ("import sys, conflux_cluster.engine.contracts.request, conflux_cluster.engine.contracts.step, "
            "conflux_cluster.engine.contracts.stream, conflux_cluster.engine.contracts.cluster, "
            "conflux_cluster.router.policies; "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_what_crosses_a_process_boundary_needs_no_torch() -> None:
    """Step inputs and results (engine/contracts/step.py), the ingress <-> instance messages (engine/contracts/,
    actors/feeds.py), the ingress's transport (serve/backend.py, serve/feed_client.py) and the HTTP ingress
    itself (it resolves the model and loads its tokenizer; the weights are the ranks' business)."""
    modules = ("conflux_cluster.engine.contracts.step", "conflux_cluster.engine.util.seeds", "conflux_cluster.engine.contracts.stream",
               "conflux_cluster.actors.feeds", "conflux_cluster.serve.backend", "conflux_cluster.serve.feed_client",
               "conflux_cluster.serve.ingress", "conflux_cluster.serve.handlers", "conflux_cluster.engine.loader")
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_context_rule_is_written_once() -> None:
    """prompt + output budget must fit the context, at least one output token: the ingress and the
    engine both call this function (and nothing else spells the rule out)."""
    import pytest

    from conflux_cluster.engine.contracts.request import ContextLengthExceeded, resolve_max_tokens

    assert resolve_max_tokens(10, None, 16) == 6 and resolve_max_tokens(10, 6, 16) == 6
    for prompt, out, param in ((10, 7, "max_tokens"), (16, None, "prompt"), (20, 1, "prompt")):
        with pytest.raises(ContextLengthExceeded) as e:
            resolve_max_tokens(prompt, out, 16)
        assert e.value.param == param and "maximum context length is 16 tokens" in str(e.value)
    root = ENGINE.parent
    spelled = [p for p in [*root.joinpath("conflux_cluster").rglob("*.py"), *ENGINE.rglob("*.py")]
               if "maximum context length" in p.read_text() and p != ENGINE / "contracts" / "request.py"]
    assert not spelled, spelled
