"""What the benchmark entry points share beyond ``conflux_cluster.bench``: running a subcommand.

The measuring code the entry points share (server processes, workloads, the token-accurate client,
reports, the roofline) lives in the installed package ``conflux_cluster.bench``; this module holds
only the command-line plumbing of the folders that gather several benchmarks under one entry point
(``python -m benchmarks.steps trace ...``). Each subcommand is a module of that folder with a
``main(argv)``; its summary is the first line of its docstring, read without importing it (most
import torch).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path


def summary(module: str) -> str:
    """The first line of ``module``'s docstring, read from its source (nothing is imported)."""
    spec = importlib.util.find_spec(module)
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) if spec and spec.origin else None
    return (doc or "").splitlines()[0] if doc else ""


def run_subcommand(package: str, subcommands: dict[str, str], argv: list[str] | None = None) -> int:
    """``python -m <package> NAME ARGS...``: run ``<package>.<subcommands[NAME]>.main(ARGS)``.

    subcommands: the command-line name -> the module's name inside ``package``. With no name, or
    ``-h``, prints the names with their summaries.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in subcommands:
        width = max(map(len, subcommands))
        print(f"usage: python -m {package} {{{','.join(subcommands)}}} [-h] ...\n")
        for name, module in subcommands.items():
            print(f"  {name:<{width}}  {summary(f'{package}.{module}')}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown subcommand {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    name, rest = argv[0], argv[1:]
    sys.argv = [f"python -m {package} {name}", *rest]  # argparse's prog in the subcommand's usage line
    result = importlib.import_module(f"{package}.{subcommands[name]}").main(rest)
    return result if isinstance(result, int) else 0
