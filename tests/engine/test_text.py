"""Incremental detokenization (multi-byte UTF-8) and stop strings, with the byte-level tokenizer
(every UTF-8 byte is its own token, the hardest case for incremental decoding)."""

from __future__ import annotations

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
    core.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
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
    core.add_request("stopped", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert "".join(o.new_text for o in outs) == text[:cut]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
