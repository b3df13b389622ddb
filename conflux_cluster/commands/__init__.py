"""Subcommands of ``conflux``: each module here with a ``register(subparsers)`` adds its own."""
