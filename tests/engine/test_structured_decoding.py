"""Grammar-constrained decoding in the engine (tiny random model, byte tokenizer): every constrained output
matches its grammar and ends where the grammar does; one rank and two ranks (gloo worker processes, a
pipelined engine, first tokens handed from the prefill rank to the decode rank) give the same tokens;
requests without a constraint beside them are unchanged by the constrained ones."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.structured.spec import GuideKind, StructuredOutput
from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor

MODEL = "tiny-llama"
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["a", "bb", "ccc"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "owner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    "required": ["id", "kind", "tags", "owner"]}
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ["yes", "no", "perhaps"]


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i, temp in enumerate((0.0, 0.9)):
        kw = dict(max_tokens=150, temperature=temp, seed=7 + i)
        prompt = list(b"Give JSON %d: " % i) * (3 + i)  # several blocks: chunked over ranks
        out += [(f"json-{i}", prompt, SamplingParams(structured=StructuredOutput.json_schema(SCHEMA), **kw)),
                (f"regex-{i}", prompt[:20], SamplingParams(structured=StructuredOutput(kind=GuideKind.REGEX,
                                                                                       spec=REGEX), **kw)),
                (f"choice-{i}", prompt[:9], SamplingParams(structured=StructuredOutput.choice(CHOICES), **kw)),
                (f"free-{i}", prompt[:30], SamplingParams(ignore_eos=True, max_tokens=24, temperature=temp,
                                                          seed=7 + i))]
    return out


def _run(core: EngineCore, requests) -> dict[str, tuple[list[int], str | None]]:
    for rid, prompt, params in requests:
        core.add_request(GenerateRequest(rid, prompt, params))
    out: dict[str, list] = {rid: [[], None] for rid, _, _ in requests}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id][0] += o.new_token_ids
            if o.finished:
                out[o.request_id][1] = o.finish_reason
    return {k: (v[0], v[1]) for k, v in out.items()}


def _config(**kw) -> EngineConfig:
    return EngineConfig(model=MODEL, dtype="float32", block_size=4, num_kv_blocks=256, num_threads=1,
                        load_progress=False, **kw)


@pytest.fixture(scope="module")
def single():
    src = resolve_model(MODEL)
    core = EngineCore(_config(), LocalExecutor(_config(), src), source=src)
    return _run(core, _requests()), core


def test_constrained_outputs_match_their_grammar_and_end_with_it(single):
    out, core = single
    eos = core.eos_token_ids
    for rid, (tokens, reason) in out.items():
        if rid.startswith("free"):
            assert reason == "length" and len(tokens) == 24
            continue
        text = bytes(t for t in tokens if t < 256).decode()  # a grammar's text is valid UTF-8
        assert reason == "stop" and tokens[-1] in eos, (rid, text, reason)  # ended by the grammar's EOS
        if rid.startswith("json"):
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(single):
    out, _ = single
    src = resolve_model(MODEL)
    alone = _run(EngineCore(_config(), LocalExecutor(_config(), src), source=src),
                 [r for r in _requests() if r[0].startswith("free")])
    assert alone == {k: v for k, v in out.items() if k.startswith("free")}


def test_two_ranks_give_the_same_tokens(single):
    out, _ = single
    src = resolve_model(MODEL)
    with MultiprocExecutor(_config(num_ranks=2), src) as ex:
        core = EngineCore(_config(num_ranks=2), ex, source=src)
        assert _run(core, _requests()) == out
        assert all(ex.kv_free())


def test_a_grammar_that_admits_nothing_ends_its_request_not_the_engine():
    """``anyOf: []`` (the ingress refuses it; the offline API does not look): the mask would allow no
    token; the request ends at a stop token, the requests beside it go on."""
    src = resolve_model(MODEL)
    core = EngineCore(_config(), LocalExecutor(_config(), src), source=src)
    empty = SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutput.json_schema({"anyOf": []}))
    out = _run(core, [("empty", list(b"hi"), empty), ("free", list(b"hi"), SamplingParams(max_tokens=5))])
    assert out["empty"][1] == "stop" and out["empty"][0][-1] in core.eos_token_ids
    assert out["free"][1] == "length" and len(out["free"][0]) == 5
