"""A GGUF model's tokenizer is converted once per machine and read from the user cache afterwards:
the cached one tokenizes exactly as the conversion does; a damaged entry is converted again; an
unwritable cache still gives a tokenizer."""

from __future__ import annotations

import os

import pytest

from conflux_cluster.engine.loader import load_tokenizer, resolve_model, smollm2_path
from conflux_cluster.engine.tokenizer_cache import cache_folder

TEXTS = ["Hello, wörld! 東京 \n\t  code: def f(x): return x**2", "<|im_end|> special text", "", " " * 7 + "🙂"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def _behaviour(tok) -> tuple:
    ids = [tok.encode(t) for t in TEXTS]
    return ids, [tok.decode(i) for i in ids], tok.chat_prompt_ids(CHAT), tok.eos_token_ids, len(tok.hf)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFLUX_CACHE_DIR", str(tmp_path / "conflux"))
    return tmp_path / "conflux"


def test_converted_once_then_read_from_the_cache(cache):
    src = resolve_model("smollm2-135m-instruct")
    folder = cache_folder(src.path)
    assert folder.parent == cache / "tokenizers" and not folder.exists()
    converted = load_tokenizer(src)
    assert (folder / "tokenizer.json").is_file()
    cached = load_tokenizer(src)
    assert os.path.samefile(cached.hf.name_or_path, folder)  # read from the entry, not converted again
    assert _behaviour(cached) == _behaviour(converted)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left behind
    # a damaged entry is converted again and replaced
    (folder / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(src)
    assert _behaviour(again) == _behaviour(converted)
    assert os.path.samefile(load_tokenizer(src).hf.name_or_path, folder)


def test_key_follows_the_file_and_an_unwritable_cache_still_works(tmp_path, monkeypatch):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(smollm2_path().read_bytes())
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("CONFLUX_CACHE_DIR", str(blocked))  # mkdir under a file fails
    before = cache_folder(copy)
    tok = load_tokenizer(resolve_model(str(copy)))
    assert tok.encode("Paris") and not before.exists()
    os.utime(copy, ns=(1, 1))  # the file changed: a new key
    assert cache_folder(copy) != before
