"""Offline throughput on CPU: our engine vs HF transformers' padded batched ``generate``, same run.

Workload (seeded): N requests arriving together, prompt lengths uniform in [64, 512] tokens,
output lengths uniform in [16, 256] tokens, EOS ignored (every request produces exactly its
output length), greedy. Prompts are random token ids (throughput does not depend on content).

* ours: ``LLM``-engine with continuous batching + chunked prefill (one rank), KV pool sized to
  the workload (sum over requests of ceil((prompt + output) / block_size) blocks).
* HF: one left-padded batch, ``generate(max_new_tokens = min_new_tokens = max output)``; a
  padded batch cannot stop rows individually, so its useful tokens are the same sum of output
  lengths, produced in the time of the longest.

Each system runs in its own subprocess, one after the other. On a shared machine wall-clock
rates depend on the other load, so CPU time of the process is reported too (tokens per
CPU-second is the steadier comparison).

Each system runs in its own subprocess (so each peak RSS is its own); reported: output tok/s,
wall time, peak RSS of the process during generation (sampled every 10 ms; weights + KV +
activations) and its growth over the RSS after loading.

    .venv/bin/python -m benchmarks.bench_engine_cpu [--requests 16] [--threads 1] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

from conflux_cluster.engine.contracts.request import GenerateRequest


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p, o = rng.randint(64, 512), rng.randint(16, 256)
        reqs.append(([rng.randrange(100, vocab) for _ in range(p)], o))
    return reqs


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """Samples this process's RSS every 10 ms in a thread: peak during generation only
    (VmHWM would also count the transient buffers of weight loading)."""

    def __init__(self) -> None:
        self.peak_kb = _rss_kb("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak_kb = max(self.peak_kb, _rss_kb("VmRSS"))

    def __enter__(self) -> "PeakRSS":
        self.base_kb = _rss_kb("VmRSS")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, _rss_kb("VmRSS"))

    def report(self) -> dict:
        return {"peak_rss_mb": self.peak_kb / 1024, "peak_growth_mb": (self.peak_kb - self.base_kb) / 1024}


def run_ours(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict:
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.core import EngineCore
    from conflux_cluster.engine.runtime.executor import LocalExecutor
    from conflux_cluster.engine.loader import resolve_model
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.engine.scheduler.config import SchedulerConfig
    from conflux_cluster.engine.tokenizer import ByteTokenizer

    bs = 16
    blocks = sum(-(-(len(p) + o) // bs) for p, o in reqs)
    cfg = EngineConfig(model=args.model, dtype="float32", block_size=bs, num_kv_blocks=blocks, load_progress=False,
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=len(reqs)))
    src = resolve_model(cfg.model)
    core = EngineCore(cfg, LocalExecutor(cfg, src), source=src, tokenizer=ByteTokenizer())  # text unused here
    core.add_request(GenerateRequest("warmup", reqs[0][0][:32],
                                     SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    with PeakRSS() as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (p, o) in enumerate(reqs):
            core.add_request(GenerateRequest(str(i), p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)))
        produced, steps = 0, 0
        while core.has_unfinished():
            produced += sum(len(x.new_token_ids) for x in core.step())
            steps += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"output_tokens": produced, "wall_s": wall, "cpu_s": cpu, "steps": steps, "kv_blocks": blocks,
            **mem.report()}


def run_hf(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from conflux_cluster.engine.loader import SMOLLM2_FILE, smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=SMOLLM2_FILE,
                                                 dtype=torch.float32).eval()
    pad = 0
    longest = max(len(p) for p, _ in reqs)
    ids = torch.full((len(reqs), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):  # left padding
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    max_out = max(o for _, o in reqs)
    with torch.no_grad():
        model.generate(ids[:1, -32:], attention_mask=mask[:1, -32:], max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                                 do_sample=False, pad_token_id=pad)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert out.shape[1] == longest + max_out
    useful = sum(o for _, o in reqs)
    return {"output_tokens": useful, "computed_tokens": len(reqs) * max_out, "wall_s": wall, "cpu_s": cpu,
            **mem.report()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per system (1: on a shared machine multi-threaded GEMMs stall)")
    ap.add_argument("--chunk", type=int, default=512, help="our token budget per step (max_num_batched_tokens)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--role", choices=["ours", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    reqs = workload(args.requests, args.seed, vocab=49152)
    if args.role:
        import torch

        torch.set_num_threads(args.threads)
        result = (run_ours if args.role == "ours" else run_hf)(args, reqs)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)} "
          f"(max {max(len(p) for p, _ in reqs)}), output tokens {sum(o for _, o in reqs)} "
          f"(max {max(o for _, o in reqs)}), threads={args.threads}, chunk={args.chunk}", flush=True)
    results = {}
    for role in ("ours", "hf"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out_path = tmp.name
        cmd = [sys.executable, __file__, "--role", role, "--out", out_path] + sys.argv[1:]
        subprocess.run(cmd, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
        with open(out_path) as f:
            results[role] = json.load(f)
        os.unlink(out_path)
        r = results[role]
        print(f"{role:>4}: {r['output_tokens']} output tokens in {r['wall_s']:.1f} s = "
              f"{r['output_tokens'] / r['wall_s']:.1f} tok/s ({r['output_tokens'] / r['cpu_s']:.1f} per CPU-second); peak RSS {r['peak_rss_mb']:.0f} MB "
              f"(+{r['peak_growth_mb']:.0f} MB during generation)", flush=True)
    ours, hf = results["ours"], results["hf"]
    ratio = (ours["output_tokens"] / ours["wall_s"]) / (hf["output_tokens"] / hf["wall_s"])
    cpu_ratio = (ours["output_tokens"] / ours["cpu_s"]) / (hf["output_tokens"] / hf["cpu_s"])
    print(f"throughput ratio ours/HF = {ratio:.2f}x wall, {cpu_ratio:.2f}x per CPU-second (target >= 1.5x); "
          f"peak RSS ratio ours/HF = {ours['peak_rss_mb'] / hf['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()
