"""Time to first token of a request whose long prefix is cached, vs the same request without the
cache (CPU, SmolLM2, an XP instance of N ranks: the scatter of the cached prefix is included).

    .venv/bin/python benchmarks/prefix_cache_cpu.py --ranks 2 --prefix 1536 --suffix 32

Prints seconds per request (median of --repeats) and the ratio; checks the tokens are equal.
A benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.llm import LLM


def _ttft(llm: LLM, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    times, tokens = [], []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([p], params)
        times.append(time.perf_counter() - t)
        tokens.append(out[0].outputs[0].token_ids)
    return times, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=1536, help="shared prompt tokens")
    ap.add_argument("--suffix", type=int, default=32, help="tokens after the shared prefix, per request")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rng = random.Random(0)
    prefix = [rng.randrange(100, 30000) for _ in range(a.prefix)]
    prompts = [prefix + [rng.randrange(100, 30000) for _ in range(a.suffix)] for _ in range(a.repeats + 1)]
    results = {}
    for caching in (False, True):
        sched = SchedulerConfig(enable_prefix_caching=caching, max_num_batched_tokens=4096, prefix_pin_tokens=0)
        llm = LLM(model="smollm2-135m-instruct", dtype="float32", ranks=a.ranks, num_threads=1,
                  load_progress=False, scheduler=sched)
        try:
            times, tokens = _ttft(llm, prompts)  # the first request fills the cache
            hits = llm.engine.scheduler.prefix.hits if llm.engine.scheduler.prefix else 0
        finally:
            llm.shutdown()
        results[caching] = (statistics.median(times[1:]), tokens, hits)
        print(f"cache {'on ' if caching else 'off'}: first {times[0]:.3f} s, then median {results[caching][0]:.3f} s "
              f"per request ({a.prefix}+{a.suffix} tokens, {a.ranks} ranks; cached tokens served: {hits})")
    assert results[True][1] == results[False][1], "tokens differ with the cache on"
    print(f"speed-up of a cached-prefix request: {results[False][0] / results[True][0]:.2f}x (tokens equal)")


if __name__ == "__main__":
    main()
