"""What a request's output must match: the typed contract that travels ingress -> instance -> ranks.

Light on purpose (pydantic only): the ingress and the scheduler-only instance process import it without
torch or xgrammar. ``grammar.py`` turns it into an xgrammar grammar where one is needed.
"""

from __future__ import annotations

import json
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class GuideKind(str, Enum):
    """How ``StructuredOutput.spec`` is read."""

    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema (JSON text); strict: no properties beyond it
    JSON_OBJECT = "json_object"  # spec unused: any JSON object
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # spec: a JSON list of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # spec: an EBNF grammar (xgrammar / GBNF dialect) with a ``root`` rule
    STRUCTURAL_TAG = "structural_tag"  # spec: an xgrammar structural tag (JSON); forced tool calls


class StructuredOutput(BaseModel):
    """A constraint on a request's whole output. The output may end (EOS) only where the grammar
    accepts, and must end there when the grammar can go no further."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GuideKind = Field(description="how to read spec")
    spec: str = Field("", max_length=1_000_000, description="the schema / pattern / grammar text (see GuideKind)")

    @classmethod
    def json_schema(cls, schema: dict) -> "StructuredOutput":
        """A schema as compact JSON text (key order kept: properties are generated in declared order)."""
        return cls(kind=GuideKind.JSON_SCHEMA, spec=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, options: list[str]) -> "StructuredOutput":
        return cls(kind=GuideKind.CHOICE, spec=json.dumps(list(options), ensure_ascii=False))

    def key(self) -> tuple[str, str]:
        """The compiled-grammar cache key."""
        return (self.kind.value, self.spec)
