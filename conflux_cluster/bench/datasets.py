"""Text datasets of ``vllm bench serve``, read from local files: ShareGPT and a jsonl of prompts.

    sharegpt  a JSON list of {"conversations": [{"from": "human", "value": ...},
                                                {"from": "gpt", "value": ...}, ...]}:
              prompt = turn 1, output length = turn 2's tokens (or a fixed --sharegpt-output-len);
              vLLM's filter: prompt >= 4 and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048
    custom    jsonl, one {"prompt": "..."} per line; output length fixed (--custom-output-len)

Conversations are shuffled with the seed (as vLLM does) and the first ``num_requests`` that pass the
filter are taken. Lengths are counted with the given tokenizer; the server reports its own count
of each prompt (the client keeps that one). Arrivals are gamma-distributed (``workload.arrival_gap``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from .workload import BenchRequest, arrival_gap

DATASETS = ("random", "sharegpt", "custom")


class Encoder(Protocol):
    """What a dataset needs of a tokenizer (``engine.tokenizer.Tokenizer`` is one)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class TextSample:
    """One text prompt and the output length to ask for."""

    prompt: str
    input_len: int  # prompt tokens by the client's tokenizer
    output_len: int


def sharegpt(path: str | Path, num_requests: int, tokenizer: Encoder, seed: int = 0,
             output_len: int | None = None) -> list[TextSample]:
    """The first ``num_requests`` usable two-turn conversations of a ShareGPT JSON file, shuffled."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    convs = [_two_turns(d["conversations"], path, i) for i, d in enumerate(data)
             if isinstance(d, dict) and len(d.get("conversations") or ()) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[TextSample] = []
    for conv in convs:
        prompt, completion = conv[0].get("value", ""), conv[1].get("value", "")
        n_in = len(tokenizer.encode(prompt))
        n_out = output_len if output_len is not None else len(tokenizer.encode(completion))
        if n_in < 4 or (output_len is None and n_out < 4) or n_in > 1024 or n_in + n_out > 2048:
            continue  # vLLM's filter (too short to time, or too long for the default context)
        out.append(TextSample(prompt, n_in, n_out))
        if len(out) == num_requests:
            break
    return _enough(out, num_requests, path)


def _two_turns(conv: object, path: str | Path, index: int) -> list[dict]:
    """The conversation's first two turns, or a ValueError naming the entry: each must be an object whose
    ``value`` (absent: empty) is text, the prompt and the reply the tokenizer counts."""
    turns = conv[:2] if isinstance(conv, list) else None
    if turns is None or not all(isinstance(t, dict) and isinstance(t.get("value", ""), str) for t in turns):
        raise ValueError(f"{path}: entry {index}: 'conversations' must be a list of turns, each an object with a "
                         "string 'value' (ShareGPT's format)")
    return turns


def custom(path: str | Path, num_requests: int, tokenizer: Encoder, output_len: int, seed: int = 0,
           shuffle: bool = False) -> list[TextSample]:
    """The first ``num_requests`` prompts of a jsonl file of ``{"prompt": ...}`` lines."""
    prompts = []
    with open(path) as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{k}: expected a JSON object with a 'prompt' field") from None
    if shuffle:
        random.Random(seed).shuffle(prompts)
    out = [TextSample(p, len(tokenizer.encode(p)), output_len) for p in prompts[:num_requests]]
    return _enough(out, num_requests, path)


def random_text(num_requests: int, input_len: int, output_len: int, tokenizer: Encoder, vocab_size: int,
                range_ratio: float = 0.0, seed: int = 0) -> list[TextSample]:
    """The random dataset as text (for the chat endpoint): random token ids decoded by the tokenizer,
    as vLLM builds it; the server's count of each prompt may differ a little from ``input_len``."""
    from .workload import prompt_ids, synthetic

    rng = random.Random(seed)
    shapes = synthetic(num_requests, input_len, output_len, range_ratio=range_ratio, seed=seed)
    return [TextSample(tokenizer.decode(prompt_ids(r.input_len, vocab_size, rng)), r.input_len, r.output_len)
            for r in shapes]


def schedule(samples: list[TextSample], request_rate: float, burstiness: float = 1.0,
             seed: int = 0) -> tuple[list[BenchRequest], list[str]]:
    """Arrival times for ``samples`` (gamma gaps, mean 1/rate) -> the requests and their prompts."""
    rng = random.Random(seed)
    t, requests = 0.0, []
    for s in samples:
        requests.append(BenchRequest(t, s.input_len, s.output_len))
        t += arrival_gap(rng, request_rate, burstiness)
    return requests, [s.prompt for s in samples]


def _enough(out: list[TextSample], num_requests: int, path: str | Path) -> list[TextSample]:
    if not out:
        raise ValueError(f"{path}: no usable prompts")
    if len(out) < num_requests:
        raise ValueError(f"{path}: only {len(out)} usable prompts, {num_requests} requested (--num-prompts)")
    return out
