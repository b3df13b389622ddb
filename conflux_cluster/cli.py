"""The ``conflux`` command: a small dispatcher over subcommand modules.

Every module in ``conflux_cluster/commands/`` that defines ``register(subparsers)`` adds its
subcommands; ``register`` calls ``subparsers.add_parser(...)`` and sets ``func=<handler(args) -> int>``
with ``parser.set_defaults``. Keep heavy imports (torch, ray) inside the handlers so that
``conflux --help`` stays fast. Adding a subcommand = adding a module; this file does not change.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from conflux_cluster import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conflux", description="ConfluxServe: SLO-aware LLM serving with "
                                                                 "Conflux Parallelism on Ray")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if callable(register):
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # user mistakes (bad model, bad parameters) and files or hosts the
        print(f"conflux {args.command}: error: {e}", file=sys.stderr)  # user named that cannot be used (missing,
        return 2  # unreadable, a folder, unreachable): one line, not a traceback


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
