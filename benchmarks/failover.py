"""Failover after a rank kill (issue 12, item 3): time to first success, errors, detection and rebuild.

Starts ``conflux serve``'s app (local Ray; default model SmolLM2 unless --model) with --instances K,
opens --streams long streams, SIGKILLs rank 1 of xp-0, then sends one short request every 100 ms until
xp-0 has rebuilt and every stream ended. Prints one JSON line:

    first_success_s   kill -> end of the first request (sent after the kill) that succeeded
    detected_s        kill -> the instance saw the death ("iteration" or "watcher")
    rebuild_s         the in-place rebuild (new rank actors, weights, warm-up)
    probes_ok / probes_503, streams_aborted / streams_finished

    .venv/bin/python -m benchmarks.failover --instances 2 --streams 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import httpx


def _stream(base: str, model: str, tokens: int, out: list) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    finish, error = None, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]["code"]
            elif event["choices"] and event["choices"][0]["finish_reason"]:
                finish = event["choices"][0]["finish_reason"]
    out.append((finish, error))


def _probe(base: str, model: str) -> tuple[float, int, str, float]:
    sent = time.time()
    r = httpx.post(f"{base}/v1/completions", timeout=600,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    code = "" if r.status_code == 200 else r.json()["error"]["code"]
    return sent, r.status_code, code, time.time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=400)
    args = ap.parse_args()

    from ray import serve

    from conflux_cluster.config import ServeConfig
    from conflux_cluster.serve.app import run

    t0 = time.time()
    cfg = run(ServeConfig(model=args.model, port=0, instances=args.instances))
    base = f"http://127.0.0.1:{cfg.port}"
    started_s = time.time() - t0
    assert _probe(base, args.model)[1] == 200
    xp0 = serve.get_deployment_handle("xp-0", app_name=cfg.app_name)
    results: list = []
    threads = [threading.Thread(target=_stream, args=(base, args.model, args.stream_tokens, results))
               for _ in range(args.streams)]
    for t in threads:
        t.start()
    while sum(serve.get_deployment_handle(f"xp-{i}", app_name=cfg.app_name).num_open_streams.remote().result()
              for i in range(args.instances)) < args.streams:
        time.sleep(0.1)
    time.sleep(1.0)  # decoding
    on_xp0 = xp0.num_open_streams.remote().result()
    os.kill(xp0.placement.remote().result().rank_pids[1], signal.SIGKILL)
    t_kill = time.time()
    probes = []
    while time.time() - t_kill < 600:
        probes.append(_probe(base, args.model))
        if probes[-1][1] == 200 and not any(t.is_alive() for t in threads) \
                and xp0.failover_stats.remote().result().rebuilds >= 1:
            break
        time.sleep(max(0.0, 0.1 - (time.time() - probes[-1][0])))
    for t in threads:
        t.join()
    stats = xp0.failover_stats.remote().result()
    ok = [p for p in probes if p[1] == 200]
    print(json.dumps({
        "model": args.model, "instances": args.instances, "streams": args.streams, "streams_on_killed": on_xp0,
        "startup_s": round(started_s, 1),
        "first_success_s": round(min(p[3] for p in ok) - t_kill, 2) if ok else None,
        "detected_s": round(stats.last_detected - t_kill, 2), "detected_by": stats.last_cause,
        "rebuild_s": round(stats.last_rebuild_s, 1),
        "probes_ok": len(ok), "probes_503": sorted({p[2] for p in probes if p[1] != 200}),
        "probes_refused": sum(p[1] != 200 for p in probes),
        "streams_finished": sum(f in ("length", "stop") and e is None for f, e in results),
        "streams_aborted": sum(f == "abort" for f, _ in results),
        "stream_errors": sorted({e for _, e in results if e}),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg()[0],
    }))
    serve.shutdown()


if __name__ == "__main__":
    main()
