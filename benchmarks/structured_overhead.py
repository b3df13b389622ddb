"""Decode TPOT of grammar-constrained (``json_schema``) requests against free-form requests of the same shapes.

``batch`` requests (random prompts of ``prompt_len`` tokens, ``max_tokens`` outputs, greedy) run together
through one engine instance, twice: free-form (EOS ignored) and with a ``json_schema`` whose output cannot
complete within ``max_tokens`` (an array of at least 10,000 small objects: strings, integers, enums), so
both runs decode the same batch for the same number of steps. TPOT is the wall time of the engine steps
that decode exactly ``batch`` requests and prefill nothing (mean and median); the ratio is the cost of
structured decoding (bitmask fill on the host during the forward, its copy and its application).

Random-weight presets use the byte tokenizer (256 real tokens), which makes the grammar's mask cheaper than
with a real 128K vocabulary: point ``--model`` at a Hugging Face directory (its tokenizer comes with it)
for the figure that counts.

    .venv/bin/python benchmarks/structured_overhead.py --device cuda --model llama-3.1-8b --batch 64
    .venv/bin/python benchmarks/structured_overhead.py --device cpu --model tiny-llama --batch 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.structured.spec import StructuredOutput
from conflux_cluster.engine.xp.spec import instance_executor

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "id": {"type": "integer"},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["name", "id", "kind"]}}}, "required": ["items"]}


def decode_step_times(core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[float]:
    """Run every prompt to its end; the wall times of the steps that decode all of them and prefill nothing."""
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    times = []
    while core.has_unfinished():
        t0 = time.perf_counter()
        core.step()
        dt = time.perf_counter() - t0
        plan = core.last_plan
        if plan is not None and not plan.prefill and sum(len(d) for d in plan.decode) == len(prompts):
            times.append(dt)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny-llama", help="a preset, a built-in name or an HF directory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating (the first warms up)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)

    source = resolve_model(args.model)
    blocks = args.batch * (-(-(args.prompt_len + args.max_tokens) // 16) + 1) + 16
    config = EngineConfig(model=args.model, device=args.device, num_kv_blocks=blocks, load_progress=False,
                          num_threads=args.threads)
    core = EngineCore(config, instance_executor(config, source), source=source)
    rng = random.Random(0)
    top = min(source.config.vocab_size, 256 if source.kind == "preset" else source.config.vocab_size)
    prompts = [[rng.randrange(3, top) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    modes = {"free-form": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                           structured=StructuredOutput.json_schema(SCHEMA))}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, params in modes.items():
            t = decode_step_times(core, prompts, params, f"{mode}-{r}")
            if r or args.repeats == 1:
                times[mode] += t
    print(f"{args.model} on {args.device}: batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} tokens")
    for mode, t in times.items():
        print(f"  {mode:12s} decode TPOT mean {statistics.mean(t) * 1e3:8.2f} ms  median "
              f"{statistics.median(t) * 1e3:8.2f} ms  ({len(t)} steps)")
    mean = {m: statistics.mean(t) for m, t in times.items()}
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"  ratio json_schema / free-form: mean {mean['json_schema'] / mean['free-form']:.3f}  "
          f"median {med['json_schema'] / med['free-form']:.3f}")


if __name__ == "__main__":
    main()
