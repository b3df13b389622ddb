"""One rank's grammar masks (engine/structured/matchers.py) without a model: the rows a step samples get the
tokens their grammar allows, the byte tokenizer's padding ids are never allowed, tokens reach a matcher once
and in order, and the sampler's mask kernel sets exactly the cleared bits to -inf."""

from __future__ import annotations

import pytest
import torch

from conflux_cluster.engine.structured.matchers import RankGrammars, apply_token_bitmask
from conflux_cluster.engine.structured.spec import GuideKind, StructuredOutput
from conflux_cluster.engine.tokenizer import ByteTokenizer

VOCAB = 128256  # llama-3.1-8b's logits over the byte tokenizer (the random-weight preset)
STOPS = [ByteTokenizer.EOS, 128001, 128009]  # the tokenizer's EOS and the model config's
REGEX = StructuredOutput(kind=GuideKind.REGEX, spec=r"ab[0-9]")


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    words = bitmask[row].tolist()
    return {32 * w + b for w, x in enumerate(words) for b in range(32) if (x >> b) & 1}


@pytest.fixture()
def grammars():
    g = RankGrammars(ByteTokenizer, VOCAB, STOPS)
    yield g
    g.shutdown()


def test_rows_get_their_grammars_tokens_and_free_rows_all(grammars):
    grammars.add("c", REGEX)
    mask = grammars.fill(["free", "c"])
    assert mask.shape == (2, VOCAB // 32) and mask.dtype == torch.int32
    assert grammars.grammar_vocab == ByteTokenizer.EOS + 1  # the padding ids are not described to xgrammar
    assert _allowed(mask, 0) == set(range(VOCAB))
    assert _allowed(mask, 1) == {ord("a")}
    grammars.accept("c", 0, ord("a"))
    grammars.accept("c", 0, ord("a"))  # sent again (first_tokens): no second advance
    assert _allowed(grammars.fill(["c"]), 0) == {ord("b")}
    grammars.accept("c", 1, ord("b"))
    grammars.accept("c", 2, ord("7"))
    assert _allowed(grammars.fill(["c", "free"]), 0) == {ByteTokenizer.EOS}  # complete: the grammar's stop
    with pytest.raises(RuntimeError, match="arrived before"):
        grammars.accept("c", 4, ord("x"))


def test_after_its_stop_a_row_takes_only_stop_tokens(grammars):
    grammars.add("c", REGEX, outputs=list(b"ab1"))  # a recomputed request: its outputs so far
    grammars.accept("c", 3, ByteTokenizer.EOS)
    assert _allowed(grammars.fill(["c"]), 0) == set(STOPS)  # a pipelined engine's one extra decode


def test_a_grammar_with_no_way_on_allows_only_stops(grammars):
    grammars.add("dead", StructuredOutput.json_schema({"anyOf": []}))
    allowed = _allowed(grammars.fill(["dead"]), 0)
    assert allowed and allowed <= set(STOPS)


def test_a_grammar_that_fails_on_the_rank_ends_its_request_alone(grammars):
    """A grammar the ingress let through but the rank cannot build (here a regex that is not one, added
    past the ingress) ends its own request at a stop token; the step's other rows keep their masks."""
    grammars.add("bad", StructuredOutput(kind=GuideKind.REGEX, spec="ab("))
    grammars.add("c", REGEX)
    mask = grammars.fill(["bad", "c", "free"])
    assert _allowed(mask, 0) <= set(STOPS) and _allowed(mask, 0)
    assert _allowed(mask, 1) == {ord("a")} and _allowed(mask, 2) == set(range(VOCAB))
    grammars.accept("bad", 0, ByteTokenizer.EOS)  # its stop token, then later steps: still only stops
    assert _allowed(grammars.fill(["bad"]), 0) <= set(STOPS)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA GPU (xgrammar's Triton kernel)"))]


@pytest.mark.parametrize("device", DEVICES)
def test_mask_kernel_clears_exactly_the_refused_tokens(device):
    gen = torch.Generator().manual_seed(0)
    for vocab in (320, 1000, 128256):  # a whole number of words, and not; llama-3's vocabulary
        logits = torch.randn(3, vocab, generator=gen)
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, -(-vocab // 32)), dtype=torch.int32, generator=gen)
        out = logits.to(device)
        apply_token_bitmask(out, bitmask.to(device))
        words = bitmask.repeat_interleave(32, dim=1)[:, :vocab]
        bits = torch.arange(vocab) % 32
        allowed = ((words >> bits) & 1).bool()
        assert torch.equal(out.cpu(), logits.masked_fill(~allowed, float("-inf")))


TINY_VOCAB = 320  # the tiny presets' logits: word 8 covers ids 256..287, past xgrammar's 258 ids
JSON_ANY = StructuredOutput(kind=GuideKind.JSON_OBJECT)


def test_a_filled_mask_allows_no_id_past_the_grammars_vocabulary():
    g = RankGrammars(ByteTokenizer, TINY_VOCAB, [ByteTokenizer.EOS])
    try:
        g.add("j", JSON_ANY)
        for i, t in enumerate(b'{"a": "x'):  # inside a string: the last word is all allowed to xgrammar
            g.accept("j", i, t)
        mask = g.fill(["j", "free"])
        assert mask.shape == (2, TINY_VOCAB // 32) and g.grammar_vocab == ByteTokenizer.EOS + 1
        assert max(_allowed(mask, 0)) < g.grammar_vocab
        assert {ord("y"), ord('"')} <= _allowed(mask, 0)
        assert _allowed(mask, 1) == set(range(TINY_VOCAB))  # an unconstrained row keeps every id
    finally:
        g.shutdown()


def test_sampling_under_a_json_grammar_never_picks_a_padding_id():
    from conflux_cluster.engine.sampling import SampleSpec, sample
    from conflux_cluster.engine.sampling_params import SamplingParams

    g = RankGrammars(ByteTokenizer, TINY_VOCAB, [ByteTokenizer.EOS])
    gen = torch.Generator().manual_seed(1)
    try:
        g.add("j", JSON_ANY)
        for i in range(60):
            logits = torch.randn(1, TINY_VOCAB, generator=gen)
            logits[0, ByteTokenizer.EOS + 1:] += 50.0  # the padding ids would win any unmasked draw
            spec = SampleSpec(SamplingParams(temperature=1.0, max_tokens=60), seed=3, output_index=i)
            token = sample(logits, [spec], g.fill(["j"])).token_ids[0]
            assert token < g.grammar_vocab, (i, token)
            if token == ByteTokenizer.EOS:
                break
            g.accept("j", i, token)
    finally:
        g.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_ids_past_a_narrow_masks_words_are_refused(device):
    logits = torch.zeros(2, TINY_VOCAB, device=device)
    bitmask = torch.full((2, 9), -1, dtype=torch.int32, device=device)  # covers ids < 288 only
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[:, :288]).all() and torch.isinf(logits[:, 288:]).all()


def test_repetition_counts_past_int32_are_refused_when_built(grammars):
    """xgrammar reads a ``{m,n}`` count as an int32: ``a{0,4294967298}`` built as ``a{0,2}`` (another constraint,
    unseen) and ``a{0,2147483648}`` built (so the ingress took it) but failed to compile on the rank, raising in
    its step. ``to_grammar`` (the ingress's check) refuses both, in a regex, an EBNF grammar and a schema's
    ``pattern`` or ``patternProperties``; the largest count it reads still compiles on the rank."""
    from conflux_cluster.engine.structured.grammar import to_grammar

    for n in (2**31, 2**32 + 2, 10**30):
        for spec in (StructuredOutput(kind=GuideKind.REGEX, spec=f"a{{0,{n}}}"),
                     StructuredOutput(kind=GuideKind.REGEX, spec=f"[0-9]{{{n}}}"),
                     StructuredOutput(kind=GuideKind.GRAMMAR, spec=f'root ::= "a"{{{n},}}'),
                     StructuredOutput.json_schema({"type": "object", "properties": {"s": {
                         "type": "string", "pattern": f"^x{{{n}}}$"}}}),
                     StructuredOutput.json_schema({"type": "object", "patternProperties": {
                         f"^k{{0,{n}}}$": {"type": "integer"}}})):
            with pytest.raises(ValueError, match="repetition count"):
                to_grammar(spec)
    edge = StructuredOutput(kind=GuideKind.REGEX, spec=f"a{{0,{2**31 - 1}}}")
    to_grammar(edge)
    grammars.add("r", edge)
    assert ord("a") in _allowed(grammars.fill(["r"]), 0)
    described = StructuredOutput.json_schema({"type": "string", "description": "{99999999999}"})  # not a pattern
    to_grammar(described)
