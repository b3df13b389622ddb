"""Command-line flags generated from pydantic fields: the field's type, default and description are
written once, on the model, and ``conflux serve`` / ``generate`` / ``chat`` derive their flags from
them (STYLE.md habit 12).

    field  gpu_memory_utilization: float = Field(0.9, description="CUDA: fraction of ...")
    flag   --gpu-memory-utilization FLOAT   CUDA: fraction of ... (default: 0.9)

Values stay strings (bools: ``--x`` / ``--no-x``; lists: the flag repeats) and are left unset
(``None``) when not given, so that the model validates them (an error names the field) and a YAML
file or the model's own default fills what the command line did not say.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from dataclasses import dataclass
from typing import Any

_UNSET: Any = object()


@dataclass(frozen=True)
class FieldFlag:
    """One flag generated from a pydantic field."""

    flag: str  # --gpu-memory-utilization
    dest: str  # attribute on the parsed args
    field: str  # the field's name
    info: Any  # its pydantic FieldInfo: type, default and description (the help text)
    section: str | None = None  # the sub-model the field belongs to (e.g. "scheduler"); None: top level
    default: Any = _UNSET  # the command's own default when it differs from the field's (shown in help)

    @property
    def scheduler(self) -> bool:
        """A SchedulerConfig field (goes into ServeConfig.scheduler)."""
        return self.section == "scheduler"

    def shown_default(self) -> Any:
        return self.info.get_default(call_default_factory=True) if self.default is _UNSET else self.default

    def add_to(self, parser: argparse._ActionsContainer, *aliases: str) -> None:
        help_ = self.info.description or self.field
        if "default" not in help_.lower():  # descriptions that explain their default keep their words
            help_ += f" (default: {_show(self.shown_default())})"
        help_ = help_.replace("%", "%%")
        names = (self.flag, *aliases)
        base = _base_types(self.info.annotation)
        if base == {bool}:  # --x / --no-x; absent: the file's or the default
            parser.add_argument(*names, dest=self.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_)
        elif all(typing.get_origin(t) is list for t in base):  # list[str]: the flag repeats
            parser.add_argument(*names, dest=self.dest, action="append", default=None,
                                metavar=_metavar(typing.get_args(next(iter(base)))[0]), help=help_ + " (repeatable)")
        else:
            extra = self.info.json_schema_extra if isinstance(self.info.json_schema_extra, dict) else {}
            metavar = "{" + ",".join(extra["choices"]) + "}" if "choices" in extra else _metavar(self.info.annotation)
            parser.add_argument(*names, dest=self.dest, default=None, metavar=metavar, help=help_)

    def value(self, args: argparse.Namespace) -> Any:
        """The value given on the command line, else the command's own default, else ``_UNSET``."""
        given = getattr(args, self.dest, None)
        if given is not None:
            return given
        return self.default


def field_flags(model: type, names: typing.Iterable[str] | None = None, section: str | None = None,
                prefix: str = "", defaults: dict[str, Any] | None = None) -> list[FieldFlag]:
    """Flags for ``names`` (default: every field) of a pydantic ``model``; ``defaults`` overrides
    what a command uses when the flag is absent."""
    defaults = defaults or {}
    chosen = list(model.model_fields) if names is None else list(names)
    dest_prefix = f"{section}__" if section else ""
    return [FieldFlag("--" + (prefix + name).replace("_", "-"), dest_prefix + name, name, model.model_fields[name],
                      section, defaults.get(name, _UNSET)) for name in chosen]


def collect(flags: typing.Iterable[FieldFlag], args: argparse.Namespace) -> dict[str | None, dict[str, Any]]:
    """The given values (and command defaults) per section: ``{None: {...}, "scheduler": {...}}``."""
    out: dict[str | None, dict[str, Any]] = {}
    for f in flags:
        v = f.value(args)
        if v is not _UNSET:
            out.setdefault(f.section, {})[f.field] = v
    return out


def _base_types(annotation: Any) -> set[Any]:
    """The non-None members of an annotation (``int | None`` -> {int})."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    return {a for a in args if a is not type(None)}


def _metavar(annotation: Any) -> str:
    choices: list[str] = []
    for t in _base_types(annotation):
        if typing.get_origin(t) is typing.Literal:
            choices += [str(c) for c in typing.get_args(t)]
        elif isinstance(t, type) and issubclass(t, enum.Enum):
            choices += [str(m.value) for m in t]
        else:
            return getattr(t, "__name__", str(t)).upper()
    return "{" + ",".join(choices) + "}"


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list) and not value:
        return "none"
    return str(value.value if isinstance(value, enum.Enum) else value)
