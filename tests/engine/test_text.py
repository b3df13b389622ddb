"""Incremental detokenization (multi-byte UTF-8) and stop strings, with the byte-level tokenizer
(every UTF-8 byte is its own token, the hardest case for incremental decoding)."""

from __future__ import annotations

import random

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.detokenizer import IncrementalDetokenizer
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.tokenizer import ByteTokenizer

from .helpers import byte_engine


def _stream(text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, [1, 2], stop)
    pieces = []
    for t in tok.encode(text):
        if d.add(t) is not None:
            break
        pieces.append(d.take(finished=False))
    pieces.append(d.take(finished=True))
    return pieces, d


def test_multibyte_characters_are_emitted_whole():
    text = "aé€😀 日本語 🇫🇷!"
    pieces, _ = _stream(text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces  # a 4-byte character appears once complete, as one piece


def test_stop_string_is_never_emitted_even_partially():
    pieces, d = _stream("hello wor wonderful world", stop=["world", "xyz"])
    assert d.stopped_by == "world"
    assert "".join(pieces) == "hello wor wonderful "
    emitted = ""
    for p in pieces:  # at no point did the emitted text contain a prefix of the stop at its end
        emitted += p
        assert "world" not in emitted


def test_stop_string_across_multibyte_and_earliest_match_wins():
    pieces, d = _stream("price: 5€ then 7€ end", stop=["7€", "€ then"])
    assert d.stopped_by == "€ then" and "".join(pieces) == "price: 5"


def test_engine_stop_string_ends_request():
    core = byte_engine("tiny-llama", chunk=32)
    prompt = list(range(40, 60))
    core.add_request(GenerateRequest("free", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    text, ids = "", []
    while core.has_unfinished():
        for o in core.step():
            text += o.new_text
            ids += o.new_token_ids
    stop = ByteTokenizer().decode(ids[3:5])
    if not stop or "\ufffd" in stop:
        stop = ByteTokenizer().decode(ids[3:])[:2]
    cut = text.find(stop)
    assert cut >= 0
    core.add_request(GenerateRequest("stopped", prompt,
                                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop)))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert "".join(o.new_text for o in outs) == text[:cut]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def _drive(ids: list[int], stop=()) -> tuple[str, IncrementalDetokenizer]:
    """Feed ids like EngineCore does: add, take; on a stop match or the last token, finish."""
    d = IncrementalDetokenizer(ByteTokenizer(), [1, 2], stop)
    out = ""
    for i, t in enumerate(ids):
        matched = d.add(t) is not None
        out += d.take(finished=matched or i == len(ids) - 1)
        if matched:
            break
    return out, d


def test_held_back_incomplete_tail_is_flushed_and_matched_at_finish():
    # the window ends in U+FFFD (incomplete / invalid bytes): held back while streaming, but the
    # request's end must flush it, else the emitted text differs from the decoded output
    ids = ByteTokenizer().encode("ab") + [0xE2, 0x82]  # "€" cut after 2 of its 3 bytes
    out, _ = _drive(ids)
    assert out == ByteTokenizer().decode(ids) == "ab\ufffd"
    # a stop string inside that tail is still matched (it was silently missed before)
    ids = ByteTokenizer().encode("xy") + [0xF8]  # 0xF8 is never valid UTF-8
    out, d = _drive(ids, stop=["y\ufffd"])
    assert out == "x" and d.stopped_by == "y\ufffd"
    d = IncrementalDetokenizer(ByteTokenizer(), [1, 2], ["y\ufffd"])
    for t in ids:
        assert d.add(t) is None  # not matched while the tail may still complete a character
    assert d.finish() == "y\ufffd" and d.take(finished=True) == "x"


def test_random_bytes_emitted_text_is_the_decoded_output_cut_at_the_stop():
    # invalid UTF-8 everywhere (what a random-weight model emits): the emitted text must equal the
    # decoded ids, and a stop string taken from anywhere in it must cut it at its first occurrence
    rng = random.Random(0)
    tok = ByteTokenizer()
    for _ in range(300):
        ids = [rng.choice([rng.randrange(256), rng.randrange(128, 256), 300]) for _ in range(rng.randrange(1, 14))]
        text, _ = _drive(ids)
        assert text == tok.decode(ids)
        if len(text) < 2:
            continue
        i = rng.randrange(len(text) - 1)
        stop = text[i:i + 2]
        cut, d = _drive(ids, stop=[stop])
        assert cut == text[:text.find(stop)] and d.stopped_by == stop


def test_engine_stream_equals_decoded_output_and_stops_in_the_tail():
    # the tiny random model ends this stream inside an incomplete UTF-8 sequence (prompt as in
    # tests/serve/test_instance_server.py); a stop string from the end of the text must still cut it
    core = byte_engine("tiny-llama", chunk=32)
    tok = ByteTokenizer()
    for prompt in ([80, 81, 82], list(range(40, 60))):
        core.add_request(GenerateRequest("free", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
        text, ids = "", []
        while core.has_unfinished():
            for o in core.step():
                text, ids = text + o.new_text, ids + o.new_token_ids
        assert text == tok.decode(ids)
        if len(text) < 2:
            continue
        stop = text[-2:]
        core.add_request(GenerateRequest("stopped", prompt,
                                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop)))
        outs = []
        while core.has_unfinished():
            outs += core.step()
        assert "".join(o.new_text for o in outs) == text[:text.find(stop)]
        assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_a_long_stop_string_costs_no_quadratic_search_per_token():
    """A request's stop string may be as long as its body allows (megabytes). Holding back a text tail that may
    begin it compared every tail length up to the string's length with it, at every token: O(min(text, stop)²)
    character copies per token on the engine thread, stalling every request of the instance. A stop string
    longer than ``EXACT_HOLD_MAX`` holds back its length - 1 characters (vLLM's rule for every stop string): the
    text is the same, and the stop string still ends it."""
    from conflux_cluster.engine.detokenizer import EXACT_HOLD_MAX

    class Counted(str):
        calls = 0

        def startswith(self, *args) -> bool:  # noqa: ANN002 - str's own signature
            Counted.calls += 1
            return super().startswith(*args)

    stop = Counted("ab" * 500)
    text = "c" * 1500 + stop + "tail"
    pieces, d = _stream(text, stop=[stop, "zz"])
    assert d.stopped_by == stop and "".join(pieces) == "c" * 1500  # nothing of the stop string was emitted
    assert Counted.calls <= len(text) * EXACT_HOLD_MAX, Counted.calls  # was ~1,000 a token (1,000,000 here)
    short, d = _stream("hello wor wonderful world", stop=["world", "x" * (EXACT_HOLD_MAX + 5)])
    assert "".join(short) == "hello wor wonderful " and d.stopped_by == "world"
