"""Length-bounded JSON strings (engine/structured/string_bounds.py, xgrammar#800): the schema rewrite on its
own, the compiled grammar (no raw control character inside a bounded string), and a tiny random model's
constrained outputs, which parse as strict JSON with every string within its bounds."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.structured.grammar import to_grammar, tokenizer_info
from conflux_cluster.engine.structured.spec import GuideKind, StructuredOutput
from conflux_cluster.engine.structured.string_bounds import JSON_CHAR, bound_strings, bound_tag_schemas
from conflux_cluster.engine.tokenizer import ByteTokenizer


def _pattern(low: int, high: int | str) -> str:
    return f"^{JSON_CHAR}{{{low},{high}}}$"


def test_a_bounded_string_becomes_a_pattern():
    assert bound_strings({"type": "string", "minLength": 2, "maxLength": 5}) == \
        {"type": "string", "pattern": _pattern(2, 5)}
    assert bound_strings({"type": "string", "maxLength": 3}) == {"type": "string", "pattern": _pattern(0, 3)}
    assert bound_strings({"type": "string", "minLength": 1, "description": "d"}) == \
        {"type": "string", "description": "d", "pattern": _pattern(1, "")}


def test_the_pattern_counts_json_characters():
    p = re.compile(_pattern(2, 3))
    assert p.fullmatch("ab") and p.fullmatch(r"a\n\u00e9") and p.fullmatch('é"'.replace('"', r"\""))
    assert not p.fullmatch("a") and not p.fullmatch("abcd") and not p.fullmatch("a\tb")
    assert not p.fullmatch('a"b') and not p.fullmatch("a\\") and not p.fullmatch(r"a\qb")


def test_strings_it_cannot_express_and_other_nodes_are_left_alone():
    for node in ({"type": "string", "maxLength": 3, "pattern": "^a+$"}, {"type": "string", "maxLength": 3,
                 "format": "date"}, {"type": "string", "maxLength": 3, "enum": ["ab"]},
                 {"type": "string", "minLength": 4, "maxLength": 2}, {"type": "string", "maxLength": -1},
                 {"type": "string", "maxLength": True}, {"type": ["string", "null"], "maxLength": 3},
                 {"type": "array", "maxItems": 2}, {"type": "string"}, True):
        assert bound_strings(node) == node


def test_it_recurses_through_every_subschema_and_leaves_its_input_alone():
    s = {"type": "string", "maxLength": 4}
    p = {"type": "string", "pattern": _pattern(0, 4)}
    schema = {"type": "object", "properties": {"a": s, "b": {"type": "array", "items": s, "prefixItems": [s]}},
              "additionalProperties": s, "$defs": {"d": s}, "definitions": {"d": s},
              "anyOf": [s], "oneOf": [s], "allOf": [{"properties": {"c": s}}]}
    before = json.dumps(schema)
    out = bound_strings(schema)
    assert json.dumps(schema) == before
    assert out == {"type": "object", "properties": {"a": p, "b": {"type": "array", "items": p, "prefixItems": [p]}},
                   "additionalProperties": p, "$defs": {"d": p}, "definitions": {"d": p},
                   "anyOf": [p], "oneOf": [p], "allOf": [{"properties": {"c": p}}]}
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [
        {"type": "tag", "begin": "<c>", "end": "</c>", "content": {"type": "json_schema", "json_schema": s}}]}}
    assert bound_tag_schemas(tag)["format"]["tags"][0]["content"]["json_schema"] == p


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(tokenizer_info(ByteTokenizer(), 320, [ByteTokenizer.EOS]))


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.accept_token(ByteTokenizer.EOS)


def test_bounds_past_int32_do_not_fail_on_the_rank(compiler):
    """A pattern's count past 2**31 - 1 built at the ingress and then failed xgrammar's compile on the rank (its
    step raised): a maxLength that large bounds nothing; a minLength that large is xgrammar's own 400."""
    huge = {"type": "string", "maxLength": 2**31}
    assert bound_strings(huge) == {"type": "string", "pattern": _pattern(0, "")}
    compiled = compiler.compile_grammar(to_grammar(StructuredOutput.json_schema(huge)))
    assert _accepts(compiled, '"abc"') and not _accepts(compiled, '"a\tb"')
    compiler.compile_grammar(to_grammar(StructuredOutput.json_schema({"type": "string", "minLength": 2**31 - 1})))
    with pytest.raises(ValueError, match="minLength"):
        to_grammar(StructuredOutput.json_schema({"type": "string", "minLength": 2**31, "maxLength": 2**32}))


BOUNDED = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
           "required": ["s"]}


def test_length_bounded_strings_stay_valid_json(compiler):
    """xgrammar#800: a bounded string compiled as xgrammar lowers it admits a raw TAB (invalid JSON)."""
    compiled = compiler.compile_grammar(to_grammar(StructuredOutput.json_schema(BOUNDED)))
    assert _accepts(compiled, '{"s": "ab"}') and _accepts(compiled, '{"s": "éééé"}')
    assert not _accepts(compiled, '{"s": "a\tb"}') and not _accepts(compiled, '{"s": "a\x01"}')
    assert not _accepts(compiled, '{"s": "a"}') and not _accepts(compiled, '{"s": "abcde"}')
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "separator": "\n",
           "at_least_one": True, "stop_after_first": True, "tags": [
               {"type": "tag", "begin": "<c>", "end": "</c>", "content": {"type": "json_schema",
                                                                          "json_schema": BOUNDED}}]}}
    compiled = compiler.compile_grammar(to_grammar(StructuredOutput(kind=GuideKind.STRUCTURAL_TAG,
                                                                    spec=json.dumps(tag))))
    assert _accepts(compiled, '<c>{"s": "abc"}</c>') and not _accepts(compiled, '<c>{"s": "a\tb"}</c>')


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 3, "maxLength": 8},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}, "minItems": 1,
             "maxItems": 3}},
    "required": ["name", "tags"]}


def test_constrained_outputs_respect_the_bounds():
    """A random model samples freely among the characters the grammar allows: each of its strings is
    strict JSON (no raw control character) and within its bounds."""
    cfg = EngineConfig(model="tiny-llama", dtype="float32", block_size=4, num_kv_blocks=256, num_threads=1,
                       load_progress=False)
    src = resolve_model(cfg.model)
    core = EngineCore(cfg, LocalExecutor(cfg, src), source=src)
    guide = StructuredOutput.json_schema(SCHEMA)
    for i in range(6):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=11 + i, structured=guide)
        core.add_request(GenerateRequest(f"r{i}", list(b"JSON: "), params))
    out: dict[str, list[int]] = {}
    reasons = {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for rid, tokens in out.items():
        assert reasons[rid] == "stop", (rid, reasons[rid])
        # xgrammar lets any JSON string hold UTF-8-encoded surrogates (ED A0..BF ..), bounded or not
        text = bytes(t for t in tokens if t < 256).decode("utf-8", "surrogatepass")
        jsonschema.validate(json.loads(text), SCHEMA)  # json.loads is strict: control characters refused
