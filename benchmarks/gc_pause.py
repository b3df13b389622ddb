#!/usr/bin/env python
"""How long a full garbage collection stalls a serving process, with and without the start-up heap
frozen (engine/gc_heap.py, ``ServeConfig.freeze_gc``). CPU by default, no server.

    python benchmarks/gc_pause.py                         # SmolLM2 offline engine, 64 requests
    python benchmarks/gc_pause.py --model tiny-llama --requests 16

Builds the offline engine (one in-process rank: the scheduler's and a rank's objects in one process),
serves ``--requests`` short requests, then times ``gc.collect()`` (a full, oldest-generation
collection: what CPython runs by itself once enough objects survived younger ones); then freezes the
heap, serves the same requests again and times a full collection once more. Prints both and their
ratio. A full collection holds the GIL: every thread of the process (engine and event loop) stops
for that long.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time


def full_collection_ms(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=64)
    a = p.parse_args(argv)
    from conflux_cluster.engine.gc_heap import freeze_heap
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.llm import LLM

    llm = LLM(model=a.model, num_threads=1, load_progress=False, num_kv_blocks=512)
    prompts = [f"Request {i}: list three colours." for i in range(a.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    llm.generate(prompts, params)
    tracked = len(gc.get_objects())
    before = full_collection_ms()
    frozen = freeze_heap()
    llm.generate(prompts, params)
    after = full_collection_ms()
    print(f"{a.model}, {a.requests} requests served before each measurement; {tracked:,} objects tracked")
    print(f"full collection, heap not frozen: {before:8.1f} ms")
    shown = f"{after:8.2f} ms" if after >= 0.01 else "  < 0.01 ms"
    ratio = f" ({before / after:,.0f}x shorter)" if after >= 0.01 else ""
    print(f"full collection, {frozen:,} start-up objects frozen: {shown}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
