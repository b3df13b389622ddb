"""Faults on a real server: a rank kill under load, a client-disconnect storm, KV pressure, a soak.

Each subcommand starts ``conflux serve``'s app in this process (local Ray), drives it over HTTP, checks
what must hold, prints one JSON object (also written to ``--out``) and exits 1 if a check failed::

    kill        streams in flight, SIGKILL one rank of xp-0: every stream ends (finished, or aborted with
                an in-band error), time to the first new success, the rebuild split into its parts
    disconnect  streams dropped by the client mid-prefill (some on long prompts) and mid-decode: KV back
                to zero on every rank, the next request at its normal latency
    pressure    long prompts beyond what the KV pool holds at once, together with short ones: no 5xx, no
                crash, greedy outputs equal to each prompt served alone
    soak        mixed traffic for --duration seconds: no errors, RSS / GPU memory sampled, KV back to zero

CPU (the embedded default, small sizes)::

    python -m benchmarks.faults disconnect --streams 24
    python -m benchmarks.faults all --duration 30

One H200 (the lead's run)::

    python -m benchmarks.faults all --model llama-3.1-8b --device cuda --gpu --duration 120

``--gpu`` picks the GPU sizes (200 storm streams, prompts up to 64K tokens, a 10 GB pressure pool).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

from benchmarks.fault_helpers import (Server, chat_ok, completion, drop_stream, p50, sample_memory,
                                      stream_completion)


@dataclass
class Sizes:
    """How big each fault is (``--gpu`` or the CPU defaults; flags override)."""

    kill_streams: int = 6
    kill_tokens: int = 200
    storm_streams: int = 24
    long_tokens: int = 1500  # the storm's and the pressure run's long prompts (capped to the context)
    pressure_long: int = 0  # long prompts in the pressure run (0: enough to exceed the pool 1.5 times)
    pressure_short: int = 8
    pressure_long_tokens: int | None = None  # the pressure run's long prompts (None: long_tokens)
    pressure_out: int = 64  # output tokens per pressure request: decodes grow their KV, which preempts
    pressure_kv_blocks: int | None = 96  # the pressure run's KV pool per rank (None: the product default)
    pressure_kv_gb: float | None = None
    soak_rate: float = 0.5  # requests per second
    duration_s: float = 30.0


GPU_SIZES = Sizes(kill_streams=32, kill_tokens=512, storm_streams=200, long_tokens=65536, pressure_long=0,
                  pressure_short=32, pressure_long_tokens=16384, pressure_out=256, pressure_kv_blocks=None, pressure_kv_gb=10.0, soak_rate=8.0,
                  duration_s=120.0)


@dataclass
class Result:
    fault: str
    ok: bool = True
    failed: list = field(default_factory=list)  # the checks that did not hold
    figures: dict = field(default_factory=dict)

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


async def pressure(server: Server, sizes: Sizes) -> Result:
    res = Result("pressure")
    out = sizes.pressure_out
    long_len = server.fit(sizes.pressure_long_tokens or sizes.long_tokens, out)
    pool = await server.pool_tokens()
    n_long = sizes.pressure_long or max(2, int(1.5 * pool / long_len) + 1)
    rng = random.Random(1)
    prompts = [server.random_prompt(rng, long_len) for _ in range(n_long)]
    prompts += [server.random_prompt(rng, rng.randrange(8, 64)) for _ in range(sizes.pressure_short)]
    alone = [await completion(server, p, out) for p in prompts]  # one at a time: no pressure
    preempted_before = await server.preemptions()
    t0 = time.monotonic()
    together = await asyncio.gather(*[completion(server, p, out) for p in prompts])
    res.figures = {"pool_tokens": pool, "long_prompts": n_long, "long_prompt_tokens": long_len,
                   "short_prompts": sizes.pressure_short, "prompt_tokens_at_once": sum(map(len, prompts)),
                   "pressure_run_s": round(time.monotonic() - t0, 2),
                   "preemptions": await server.preemptions() - preempted_before,
                   "statuses": sorted({s for s, _ in together}),
                   "mismatched": [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]}
    res.check("every request served (200), alone and under pressure",
              all(s == 200 for s, _ in alone + together))
    res.check("greedy outputs equal to each prompt served alone", not res.figures["mismatched"])
    res.check("KV back to zero", await server.kv_zero())
    return res


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
    samples.append(await sample_memory(server))
    errors = sum(not _served(o) for o in outs)
    # growth from the first sample after a fifth of the soak (allocators warmed) to the end
    warm = [x for x in samples if x.t >= samples[0].t + sizes.duration_s / 5] or samples
    first, last = warm[0], samples[-1]
    res.figures = {"duration_s": sizes.duration_s, "requests": len(outs), "errors": errors,
                   "rss_mb_first_last": [first.rss_mb, last.rss_mb],
                   "rss_growth": last.rss_mb / first.rss_mb - 1 if first.rss_mb else None,
                   "gpu_mb_first_last": [first.gpu_mb, last.gpu_mb],
                   "gpu_growth": last.gpu_mb / first.gpu_mb - 1 if first.gpu_mb else None,
                   "samples": [asdict(s) for s in samples]}
    res.check("0 errors", errors == 0)
    res.check("KV back to zero", await server.kv_zero())
    return res


def _served(outcome) -> bool:
    """A chat/completion ``(status, ...)`` tuple or a stream's ``StreamEnd``: served in full."""
    if isinstance(outcome, tuple):
        return outcome[0] == 200
    return outcome.finish in ("length", "stop") and not outcome.error


FAULTS = {"kill": kill, "disconnect": disconnect, "pressure": pressure, "soak": soak}


def sizes_from(a: argparse.Namespace) -> Sizes:
    s = GPU_SIZES if a.gpu else Sizes()
    over = {k: v for k, v in {"storm_streams": a.streams, "duration_s": a.duration, "long_tokens": a.long_tokens,
                              "soak_rate": a.rate}.items() if v is not None}
    return Sizes(**{**asdict(s), **over})


SHARED_ORDER = ["disconnect", "soak", "kill"]  # on one server, the kill last (it rebuilds xp-0)


async def run_group(names: list[str], model: str | None, device: str, sizes: Sizes, kv: dict) -> list[Result]:
    """``names`` in order on one server (``kv``: ServeConfig fields that size its KV pool)."""
    results = []
    async with Server.start(model, device, {k: v for k, v in kv.items() if v is not None}) as server:
        for name in names:
            t0 = time.monotonic()
            res = await FAULTS[name](server, sizes)
            res.figures["fault_s"] = round(time.monotonic() - t0, 1)
            res.figures["startup_s"] = server.startup_s
            print(json.dumps(asdict(res)), flush=True)
            results.append(res)
    return results


def run_faults(names: list[str], a: argparse.Namespace, sizes: Sizes) -> list[Result]:
    """The pressure run on its own server (a smaller KV pool); the others together on one."""
    shared = [n for n in SHARED_ORDER if n in names]
    results = asyncio.run(run_group(shared, a.model, a.device, sizes, {})) if shared else []
    if "pressure" in names:
        kv = {"num_kv_blocks": sizes.pressure_kv_blocks, "kv_cache_memory_gb": sizes.pressure_kv_gb}
        results += asyncio.run(run_group(["pressure"], a.model, a.device, sizes, kv))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("faults", nargs="+", choices=[*FAULTS, "all"], metavar="FAULT",
                   help=f"one or more of {', '.join(FAULTS)}, or all")
    p.add_argument("--model", default=None, help="default: the embedded default (SmolLM2)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gpu", action="store_true", help="the GPU sizes (see the module docstring)")
    p.add_argument("--streams", type=int, default=None, help="disconnect: streams dropped")
    p.add_argument("--long-tokens", type=int, default=None, help="long prompts' tokens (capped to the context)")
    p.add_argument("--duration", type=float, default=None, help="soak: seconds of traffic")
    p.add_argument("--rate", type=float, default=None, help="soak: requests per second")
    p.add_argument("--out", default=None, help="write the results (a JSON list) here")
    a = p.parse_args(argv)
    sizes = sizes_from(a)
    names = list(FAULTS) if "all" in a.faults else list(dict.fromkeys(a.faults))
    results = [asdict(r) for r in run_faults(names, a, sizes)]
    meta = {"model": a.model, "device": a.device, "sizes": asdict(sizes),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
