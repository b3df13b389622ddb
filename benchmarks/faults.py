"""Faults on a real server: a rank kill under load, a client-disconnect storm, KV pressure, a soak.

Each fault starts ``conflux serve``'s app in this process (local Ray), drives it over HTTP, checks what
must hold, prints one JSON object and a PASS / FAIL line per fault (all of them also written to ``--out``)
and exits 1 if a check failed::

    kill        streams in flight, SIGKILL one rank of xp-0: every stream ends (finished, or aborted with
                an in-band error), time to the first new success, the rebuild split into its parts
    disconnect  streams dropped by the client mid-prefill (some on long prompts) and mid-decode: KV back
                to zero on every rank, the next request at its normal latency
    pressure    the same requests together on two servers, one whose KV pool the decodes outgrow (they are
                preempted and recompute) and one with an ample pool, both float32: the first's preemption
                counter moves, the second's does not, greedy outputs token-identical, every stream exactly
                max_tokens long, KV back to zero, no 5xx
    soak        mixed traffic (chat, streams, long prompts) for --duration seconds at --rate: 0 errors, RSS of
                every serving process and the ranks' CUDA memory (allocated, reserved; nvidia-smi too) flat
                within 2 % from the end of --warmup to the end, KV back to zero

CPU (the embedded default, or tiny-llama for a quick look)::

    python -m benchmarks.faults disconnect --streams 24
    python -m benchmarks.faults pressure --model tiny-llama --device cpu
    python -m benchmarks.faults soak --model tiny-llama --device cpu --duration 20
    python -m benchmarks.faults all --duration 30

One H200 (the lead's runs; each well under 4 minutes)::

    python -m benchmarks.faults disconnect kill --model llama-3.1-8b --device cuda --gpu
    python -m benchmarks.faults pressure --model llama-3.1-8b --device cuda --gpu
    python -m benchmarks.faults soak --model llama-3.1-8b --device cuda --gpu --duration 120 --warmup 30

``--gpu`` picks the GPU sizes (200 storm streams, prompts up to 64K tokens; pressure: 16 prompts of 1,024
tokens and 16 short ones, 384 tokens out each, float32; soak: 16 requests/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

from benchmarks.fault_helpers import (Server, StreamEnd, chat_ok, completion, drop_stream, p50, sample_memory,
                                      stream_completion)
from conflux_cluster.engine.config import Device
from conflux_cluster.serve.preflight import CPU_RANKS


@dataclass
class Sizes:
    """How big each fault is (``--gpu`` or the CPU defaults; flags override)."""

    kill_streams: int = 6
    kill_tokens: int = 200
    storm_streams: int = 24
    long_tokens: int = 1500  # the storm's and the soak's long prompts (capped to the context)
    pressure_long: int = 4  # long prompts in the pressure run
    pressure_long_tokens: int = 256
    pressure_short: int = 8  # short prompts (8-63 tokens) beside them
    pressure_out: int = 96  # output tokens per pressure request: the decodes' growth is what preempts
    pressure_dtype: str = "float32"  # both pressure servers: a batching change cannot flip a greedy argmax
    pressure_ample_kv_gb: float | None = None  # the reference server's pool (None: the product default)
    soak_rate: float = 2.0  # requests per second
    duration_s: float = 30.0
    soak_warmup_s: float | None = None  # memory is compared from here to the end (None: a fifth of the soak)


GPU_SIZES = Sizes(kill_streams=32, kill_tokens=512, storm_streams=200, long_tokens=65536, pressure_long=16,
                  pressure_long_tokens=1024, pressure_short=16, pressure_out=384, soak_rate=16.0, duration_s=120.0)


@dataclass
class Result:
    fault: str
    ok: bool = True
    failed: list = field(default_factory=list)  # the checks that did not hold
    figures: dict = field(default_factory=dict)

    def verdict(self) -> str:
        return f"{self.fault}: PASS" if self.ok else f"{self.fault}: FAIL ({'; '.join(self.failed)})"

    def check(self, what: str, holds: bool) -> None:
        if not holds:
            self.ok = False
            self.failed.append(what)


# ---- (a) rank kill -------------------------------------------------------------------------------


async def kill(server: Server, sizes: Sizes) -> Result:
    res = Result("kill")
    base_s = await server.normal_latency()
    streams = [asyncio.create_task(stream_completion(server, [100 + i] * 32, sizes.kill_tokens))
               for i in range(sizes.kill_streams)]
    await server.wait_open_streams(sizes.kill_streams)
    await asyncio.sleep(1.0)  # decoding
    pid = (await server.rank_pids(0))[-1]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    first_ok, probes = None, []
    while time.monotonic() - t_kill < 300:
        t0 = time.monotonic()
        status = (await completion(server, [7] * 8, 4))[0]
        probes.append(status)
        if status == 200 and first_ok is None:
            first_ok = time.monotonic() - t_kill
        if first_ok is not None and all(s.done() for s in streams) and await server.rebuilds(0) >= 1:
            break
        await asyncio.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))
    ends = [await s for s in streams]
    stats = await server.instance_stats(0)
    build = stats["last_build"]
    res.figures = {"streams": len(ends), "finished": sum(e.finish in ("length", "stop") for e in ends),
                   "aborted_in_band": sum(e.finish == "abort" and bool(e.error) for e in ends),
                   "unclean": sum(not e.clean() for e in ends), "first_success_s": first_ok,
                   "probe_statuses": {str(k): probes.count(k) for k in sorted(set(probes))},
                   "rebuild_s": stats["last_rebuild_s"], "rebuild_parts_s": build,
                   "normal_latency_s": base_s}
    res.check("every stream ended cleanly (finished, or aborted with an in-band error)",
              res.figures["unclean"] == 0)
    res.check("a new request succeeded after the kill", first_ok is not None)
    res.check("no probe got a 500", 500 not in probes)
    res.check("KV back to zero", await server.kv_zero())
    return res


# ---- (b) disconnect storm ------------------------------------------------------------------------


async def disconnect(server: Server, sizes: Sizes) -> Result:
    res = Result("disconnect")
    out = 256  # output tokens asked for (the drop comes first)
    long_len = server.fit(sizes.long_tokens, out)
    base_s = await server.normal_latency()
    rng = random.Random(0)
    jobs = []
    for i in range(sizes.storm_streams):
        long = i % 10 == 0  # one in ten on a long prompt, most of them dropped mid-prefill
        prompt = server.random_prompt(rng, long_len if long else 64)
        # mid-prefill: dropped once routed, before any token; mid-decode: after a few tokens
        when = ("decode" if i % 40 == 0 else "prefill") if long else ("prefill" if i % 2 else "decode")
        jobs.append(drop_stream(server, prompt, out, when, after_tokens=rng.randrange(1, 8)))
    outcomes = await asyncio.gather(*jobs)
    after = [await server.timed_completion() for _ in range(3)]
    res.figures = {"streams": len(outcomes), "long_prompt_tokens": long_len,
                   "dropped": {w: sum(o == w for o in outcomes) for w in ("prefill", "decode")},
                   "statuses_not_200": sorted({o for o in outcomes if isinstance(o, int)}),
                   "normal_latency_s": base_s, "next_latency_s": p50(after),
                   "next_vs_normal": p50(after) / base_s if base_s and p50(after) else None}
    res.check("KV back to zero on every rank", await server.kv_zero())
    res.check("no 5xx other than 503 refusals", all(s == 503 for s in res.figures["statuses_not_200"]))
    res.check("the next requests served (200)", all(a is not None for a in after))
    res.check("the next requests at their normal latency (within 2x + 0.5 s)",
              None not in (base_s, p50(after)) and p50(after) <= 2 * base_s + 0.5)
    return res


# ---- (c) KV pressure -----------------------------------------------------------------------------
#
# The same requests, sent together, on two servers that differ only in their KV pool: a tight one, where
# the admitted decodes outgrow the pool and must be preempted (decode_reserve_tokens 0: a decode is placed
# as soon as its prompt fits), and an ample one, where nothing is preempted. Greedy outputs must be token
# for token the same (float32 by default, so that a different batching cannot flip an argmax), every
# stream must carry exactly max_tokens tokens (none lost, none sent twice after a recompute), the tight
# server's preemption counter must move and the ample one's must not, and KV must be back to zero.


@dataclass
class PressureSide:
    """One server's run of the pressure requests."""

    pool_tokens: int  # KV tokens all ranks hold at once
    preemptions: int  # the scheduler's num_preemptions over the run (/v1/conflux/stats)
    run_s: float
    ends: list[StreamEnd]
    kv_zero: bool


def pressure_prompts(model: str | None, sizes: Sizes) -> list[list[int]]:
    """Long prompts and short ones, random token ids of the model's vocabulary (seeded)."""
    from conflux_cluster.config import DEFAULT_MODEL
    from conflux_cluster.engine.loader import resolve_model

    vocab = resolve_model(model or DEFAULT_MODEL).config.vocab_size
    hi = min(vocab, 20000)
    rng = random.Random(1)
    lengths = [sizes.pressure_long_tokens] * sizes.pressure_long
    lengths += [rng.randrange(8, 64) for _ in range(sizes.pressure_short)]
    return [[rng.randrange(min(100, hi // 2), hi) for _ in range(n)] for n in lengths]


def tight_pool_blocks(prompts: list[list[int]], out: int, ranks: int, block_size: int = 16) -> int:
    """Blocks per rank for a pool that holds every prompt and 30 % of the outputs: all requests are
    admitted, then their decodes outgrow it. At least one whole request (prompt and outputs) per rank."""
    tokens = sum(map(len, prompts)) + 0.3 * out * len(prompts)
    longest = max(map(len, prompts)) + out
    return max(math.ceil(tokens / (ranks * block_size)), math.ceil(longest / block_size) + 2)


async def pressure_side(server: Server, prompts: list[list[int]], out: int) -> PressureSide:
    before = await server.preemptions()
    t0 = time.monotonic()
    ends = await asyncio.gather(*[stream_completion(server, p, out) for p in prompts])
    run_s = round(time.monotonic() - t0, 2)
    return PressureSide(await server.pool_tokens(), await server.preemptions() - before, run_s, list(ends),
                        await server.kv_zero())


async def pressure_on(model: str | None, device: Device, fields: dict, prompts: list[list[int]],
                      out: int) -> PressureSide:
    async with Server.start(model, device, fields) as server:
        return await pressure_side(server, prompts, out)


def run_pressure(model: str | None, device: Device, sizes: Sizes, kv_blocks: int | None = None) -> Result:
    """The tight server (``kv_blocks`` per rank, default ``tight_pool_blocks``), then the ample one (each
    started, run, stopped), then the checks."""
    res = Result("pressure")
    out = sizes.pressure_out
    prompts = pressure_prompts(model, sizes)
    ranks = CPU_RANKS if device is Device.CPU or not _has_cuda() else _cuda_count()
    blocks = kv_blocks or tight_pool_blocks(prompts, out, ranks)
    # a correctness run: no start-up profiling or warm-up (only the token ids are compared)
    sched = {"decode_reserve_tokens": 0, "estimator_profile": "budget"}
    common = {"dtype": sizes.pressure_dtype, "scheduler": sched, "warmup": False}
    t0 = time.monotonic()
    tight = asyncio.run(pressure_on(model, device, {**common, "num_kv_blocks": blocks}, prompts, out))
    ample = asyncio.run(pressure_on(model, device, {**common, "kv_cache_memory_gb": sizes.pressure_ample_kv_gb},
                                    prompts, out))
    mismatched = [i for i, (x, y) in enumerate(zip(tight.ends, ample.ends)) if x.token_ids != y.token_ids]
    wrong_len = [i for i, e in enumerate(tight.ends + ample.ends) if len(e.token_ids) != out]
    statuses = sorted({e.status for e in tight.ends + ample.ends})
    res.figures = {"dtype": sizes.pressure_dtype, "requests": len(prompts), "long_prompts": sizes.pressure_long,
                   "long_prompt_tokens": sizes.pressure_long_tokens, "short_prompts": sizes.pressure_short,
                   "max_tokens": out, "prompt_tokens": sum(map(len, prompts)),
                   "demand_tokens": sum(map(len, prompts)) + out * len(prompts),
                   "tight_kv_blocks_per_rank": blocks, "tight_pool_tokens": tight.pool_tokens,
                   "ample_pool_tokens": ample.pool_tokens, "preemptions_tight": tight.preemptions,
                   "preemptions_ample": ample.preemptions, "run_s_tight": tight.run_s, "run_s_ample": ample.run_s,
                   "statuses": statuses, "unclean_streams": sum(not e.clean() for e in tight.ends + ample.ends),
                   "wrong_length": wrong_len, "mismatched": mismatched, "pressure_s": round(time.monotonic() - t0, 1)}
    res.check("the tight pool preempted (its counter moved)", tight.preemptions > 0)
    res.check("the ample pool did not preempt (a reference without pressure)", ample.preemptions == 0)
    res.check("every request served (200), no 5xx", statuses == [200])
    res.check("every stream ended cleanly", res.figures["unclean_streams"] == 0)
    res.check("every stream carried exactly max_tokens tokens (none lost or sent twice)", not wrong_len)
    res.check("greedy outputs token-identical to the run without pressure", not mismatched)
    res.check("KV back to zero on both servers", tight.kv_zero and ample.kv_zero)
    return res


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


# ---- (d) soak ------------------------------------------------------------------------------------


async def soak(server: Server, sizes: Sizes) -> Result:
    res = Result("soak")
    rng = random.Random(2)
    long_len = server.fit(min(sizes.long_tokens, 8192), 64)
    samples = [await sample_memory(server)]
    tasks: list[asyncio.Task] = []
    t0 = next_sample = time.monotonic()
    while time.monotonic() - t0 < sizes.duration_s:
        kind = rng.random()
        if kind < 0.6:
            tasks.append(asyncio.create_task(chat_ok(server, rng.randrange(4, 64))))
        elif kind < 0.9:
            prompt = server.random_prompt(rng, rng.randrange(16, 512))
            tasks.append(asyncio.create_task(stream_completion(server, prompt, rng.randrange(8, 128))))
        else:
            prompt = server.random_prompt(rng, long_len)
            tasks.append(asyncio.create_task(completion(server, prompt, 16)))
        await asyncio.sleep(rng.expovariate(sizes.soak_rate))
        if time.monotonic() >= next_sample:
            samples.append(await sample_memory(server))
            next_sample += 5.0
    outs = await asyncio.gather(*tasks)
    kv_zero = await server.kv_zero()
    samples.append(await sample_memory(server))
    errors = sum(not _served(o) for o in outs)
    warmup_s = sizes.duration_s / 5 if sizes.soak_warmup_s is None else sizes.soak_warmup_s
    growth = memory_growth(samples, samples[0].t + warmup_s)
    res.figures = {"duration_s": sizes.duration_s, "rate_rps": sizes.soak_rate, "requests": len(outs),
                   "errors": errors, "statuses_not_200": _statuses_not_200(outs), "warmup_s": warmup_s,
                   "growth_after_warmup": growth, "samples": [asdict(x) for x in samples]}
    res.check("0 errors", errors == 0)
    for what, g in growth.items():
        res.check(f"{what} flat within {FLAT:.0%} after warm-up", g is None or abs(g) <= FLAT)
    res.check("KV back to zero", kv_zero)
    return res


FLAT = 0.02  # the soak's memory figures may move this much (relative) from warm-up to the end


def memory_growth(samples: list, warm_from: float) -> dict[str, float | None]:
    """Relative change of each memory figure from the first sample at or after ``warm_from`` (allocators and
    caches warmed) to the last; None where the figure is absent (no GPU)."""
    warm = [x for x in samples if x.t >= warm_from] or samples[-1:]
    first, last = warm[0], samples[-1]
    out = {}
    for name in ("rss_mb", "cuda_allocated_mb", "cuda_reserved_mb", "gpu_used_mb"):
        a, b = getattr(first, name), getattr(last, name)
        out[name] = round(b / a - 1, 4) if a and b is not None else None
    return out


def _statuses_not_200(outs: list) -> dict[str, int]:
    st = [o[0] if isinstance(o, tuple) else o.status for o in outs]
    return {str(k): st.count(k) for k in sorted(set(st)) if k != 200}


def _served(outcome) -> bool:
    """A chat/completion ``(status, ...)`` tuple or a stream's ``StreamEnd``: served in full."""
    if isinstance(outcome, tuple):
        return outcome[0] == 200
    return outcome.finish in ("length", "stop") and not outcome.error


FAULTS = {"kill": kill, "disconnect": disconnect, "soak": soak}  # on one shared server
NAMES = [*FAULTS, "pressure"]


def sizes_from(a: argparse.Namespace) -> Sizes:
    s = GPU_SIZES if a.gpu else Sizes()
    over = {k: v for k, v in {"storm_streams": a.streams, "duration_s": a.duration, "long_tokens": a.long_tokens,
                              "soak_rate": a.rate, "soak_warmup_s": a.warmup}.items() if v is not None}
    return Sizes(**{**asdict(s), **over})


SHARED_ORDER = ["disconnect", "soak", "kill"]  # on one server, the kill last (it rebuilds xp-0)


async def run_group(names: list[str], model: str | None, device: Device, sizes: Sizes,
                    fields: dict | None = None) -> list[Result]:
    """``names`` in order on one server (the product defaults, or these ServeConfig ``fields`` over them)."""
    results = []
    async with Server.start(model, device, fields or {}) as server:
        for name in names:
            t0 = time.monotonic()
            res = await FAULTS[name](server, sizes)
            res.figures["fault_s"] = round(time.monotonic() - t0, 1)
            res.figures["startup_s"] = server.startup_s
            print(json.dumps(asdict(res)), res.verdict(), sep="\n", flush=True)
            results.append(res)
    return results


def run_faults(names: list[str], a: argparse.Namespace, sizes: Sizes) -> list[Result]:
    """The pressure run on its own two servers (a tight and an ample KV pool); the others together on one."""
    shared = [n for n in SHARED_ORDER if n in names]
    results = asyncio.run(run_group(shared, a.model, a.device, sizes)) if shared else []
    if "pressure" in names:
        res = run_pressure(a.model, a.device, sizes, a.kv_blocks)
        print(json.dumps(asdict(res)), res.verdict(), sep="\n", flush=True)
        results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("faults", nargs="+", choices=[*NAMES, "all"], metavar="FAULT",
                   help=f"one or more of {', '.join(NAMES)}, or all")
    p.add_argument("--model", default=None, help="default: the embedded default (SmolLM2)")
    p.add_argument("--device", default=Device.AUTO, type=Device, choices=list(Device))
    p.add_argument("--gpu", action="store_true", help="the GPU sizes (see the module docstring)")
    p.add_argument("--streams", type=int, default=None, help="disconnect: streams dropped")
    p.add_argument("--long-tokens", type=int, default=None, help="long prompts' tokens (capped to the context)")
    p.add_argument("--duration", type=float, default=None, help="soak: seconds of traffic")
    p.add_argument("--rate", type=float, default=None, help="soak: requests per second")
    p.add_argument("--warmup", type=float, default=None, help="soak: seconds before memory is compared "
                   "(default: a fifth of --duration)")
    p.add_argument("--kv-blocks", type=int, default=None, help="pressure: the tight pool's KV blocks per rank "
                   "(default: every prompt and 30 %% of the outputs)")
    p.add_argument("--out", default=None, help="write the results (a JSON list) here")
    a = p.parse_args(argv)
    sizes = sizes_from(a)
    names = list(NAMES) if "all" in a.faults else list(dict.fromkeys(a.faults))
    results = [asdict(r) for r in run_faults(names, a, sizes)]
    meta = {"model": a.model, "device": a.device, "sizes": asdict(sizes),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
