"""The help formatter every ``conflux`` subcommand uses: the module docstring is printed as written,
and every option's help says what happens when the option is left out, so no flag is silent about
its default.

    help mentions "default" or "unset"    kept as written (it explains the default in its own words)
    a required option                     kept as written (it has no default)
    a switch (store_true / store_false)   "(default: off)": the switch is not given
    default None                          "(default: unset)"
    anything else                         "(default: <value>)"
"""

from __future__ import annotations

import argparse


def explains_default(text: str) -> bool:
    """Does a help text already say what its option's default is?"""
    lower = text.lower()
    return "default" in lower or "unset" in lower


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw description; each option's help ends with its default (see the module docstring)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.default is argparse.SUPPRESS
                or explains_default(text)):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: off)"
        if action.default is None:
            return f"{text} (default: unset)"
        return f"{text} (default: %(default)s)"
