#!/usr/bin/env bash
# The GPU machine's serving run (device tool, repository root, `.whl` carried): set-up, then
# benchmarks/gpu_serve.py (llama-3.1-8b on all visible GPUs) and tests/serve/test_serve_gpu.py. The
# benchmark runs by path, which works with the PYTHONPATH shim too (`python3 -m` would not: the
# repository's conflux_cluster/ would shadow the shim's).
# JSON results go to $OUT, every log packed into $OUT/logs.tar.gz at the end (the device returns <= 8
# files). Fits one device call (< 10 min) with the defaults below.
#
#   run(command="bash benchmarks/gpu_serve_run.sh", carry=[".whl"], kind="nvidia-h200-x2")
#
# Environment knobs: BENCH=goodput (benchmarks/gpu_goodput.py instead of gpu_serve.py; BENCH_ARGS
# are then its flags), TESTS_FIRST=1 (tests before the benchmark), BENCH_ARGS (extra gpu_serve.py flags, e.g. "--compare-policy fcfs" or
# "--server-arg=--max-num-batched-tokens=2048"), RATES (default 4,8,12,16,24), DURATION (s of
# arrivals per sweep point, default 10: short, to fit one call), BENCH_TIMEOUT / TEST_TIMEOUT (s,
# default 360 / 300; the JSON is written after every phase; the tests get at most what is left of
# TOTAL_S, default 570 s, so one call ends in time: run SKIP_BENCH=1 in a second call for the whole
# test time, e.g. when the server profiles its estimator at start), TEST_MODEL (default tiny-llama;
# llama-3.1-8b makes the long-prompt test a 128K prompt), TESTS (test files, default
# tests/serve/test_serve_gpu.py), SKIP_BENCH=1, SKIP_TESTS=1, CONFLUX_GIT_COMMIT (the commit the JSON
# names: the device's copy of .git may lag behind the tree it runs, which the JSON then marks "+dirty";
# put the local `git rev-parse --short HEAD` into the command).
# The image has torch/Triton/NCCL but no Ray/pydantic/fastapi: those come from .whl/
# (../shared/gpu/ray-wheels.sh builds it).
# Checked 2026-12-01 on 1 x H200 (SKIP_TESTS=1 RATES=4,8: 172 s; pip install -e works there) and
# 2 x H200 (burst and long prompt only).
set -u
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device notes
export RAY_USAGE_STATS_ENABLED=0
REPO=$PWD
OUT=${OUT:-/tmp/gpu_serve_out}
mkdir -p "$OUT"
ts() { echo "[$(date +%H:%M:%S)] $*"; }

ts "GPUs:"; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# 1. Ray + Serve + pydantic + fastapi + gguf from the carried wheels (kept on a warm machine).
if [ ! -d /tmp/site/ray ]; then
  ts "installing .whl/ into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
fi
# the repacked Ray wheel stores its two daemons without the executable bit (zip mode 0644)
RAYBIN="/tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet"
chmod +x $RAYBIN
export PYTHONPATH=/tmp/site
for f in $RAYBIN; do
  if [ ! -x "$f" ]; then  # e.g. /tmp mounted noexec: install the wheels into the system site instead
    ts "$f is not executable here: installing .whl/ system-wide"
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3
    sys_ray=$(cd / && env -u PYTHONPATH python3 -c 'import ray, os; print(os.path.dirname(ray.__file__))')
    chmod +x "$sys_ray/core/src/ray/gcs/gcs_server" "$sys_ray/core/src/ray/raylet/raylet"
    export PYTHONPATH=; break
  fi
done

# 2. The project itself: editable install (setup.py's package-dir mapping); if that does not work
#    here, a PYTHONPATH shim that maps engine/, router/, actors/ into conflux_cluster (gpu_env.sh).
check='import conflux_cluster.engine.config, conflux_cluster.actors.xp_deployment, conflux_cluster.router.policies, ray.serve, fastapi'
ts "installing the project (pip install -e)"
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/pip-e.log" 2>&1
if (cd /tmp && python3 -c "$check") 2>>"$OUT/pip-e.log"; then
  ts "editable install works"
else
  ts "editable install does not import (see pip-e.log): using the PYTHONPATH shim"
  NS=/tmp/ns; rm -rf $NS; mkdir -p $NS/conflux_cluster; cp -r "$REPO"/conflux_cluster/* $NS/conflux_cluster/
  for d in engine router actors; do ln -sfn "$REPO/$d" "$NS/conflux_cluster/$d"; done
  export PYTHONPATH=$NS:/tmp/site
  (cd /tmp && python3 -c "$check") || { ts "the project does not import"; exit 1; }
fi

# Ray's own logs hold the replicas' tracebacks (conflux serve runs Ray with log_to_driver=False)
ray_errors() {
  for f in $(grep -l -E "Traceback|Error" /tmp/ray/session_*/logs/serve/*.log /tmp/ray/session_*/logs/worker-*.err \
             2>/dev/null | head -30); do
    echo "== $f"; grep -B3 -A30 -E "Traceback|Error" "$f" | tail -60
  done > "$OUT/$1" 2>&1
}

rc=0
# 3. The benchmark: gpu_serve.py (served burst, first/steady request, 128K prompt, rate sweep, offline
#    engine, roofline), or with BENCH=goodput gpu_goodput.py (systems side by side, sim vs real).
run_bench() {
  if [ "${BENCH:-serve}" = goodput ]; then
    ts "benchmarks/gpu_goodput.py"
    timeout -k 30 "${BENCH_TIMEOUT:-360}" python3 "$REPO/benchmarks/gpu_goodput.py" --out "$OUT/gpu_goodput.json" \
      ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_goodput.log" | grep -v "^\s*$"
  else
    ts "benchmarks/gpu_serve.py"
    timeout -k 30 "${BENCH_TIMEOUT:-360}" python3 "$REPO/benchmarks/gpu_serve.py" --rates "${RATES:-4,8,12,16,24}" \
      --duration "${DURATION:-10}" --drain-s 10 --long-timeout 90 --out "$OUT/gpu_serve.json" ${BENCH_ARGS:-} \
      2>&1 | tee "$OUT/gpu_serve.log" | grep -v "^\s*$"
  fi
  b=${PIPESTATUS[0]}; ts "benchmark exit $b"; [ "$b" = 0 ] || rc=$b
  # always: a server that failed mid-run shows only as 503s in the results (the benchmark exits 0)
  ray_errors ray-errors-bench.log; [ -s "$OUT/ray-errors-bench.log" ] && ts "Ray logs hold errors: ray-errors-bench.log"
  # the instances' throughput lines (actors/stats_log.py), per server
  grep -h "XP instance .* output tok/s" /tmp/ray/session_*/logs/serve/*.log > "$OUT/stats-lines.log" 2>/dev/null
  rm -rf /tmp/ray/session_2*  # the next Ray's logs alone
}

# 4. The serving layer's GPU tests (pytest from /tmp: the repo root must not shadow the install).
run_tests() {
  TESTS=${TESTS:-tests/serve/test_serve_gpu.py}
  ts "$TESTS (model ${TEST_MODEL:-tiny-llama})"
  left=$(( ${TOTAL_S:-570} - SECONDS - 25 ))  # what is left of the call's time (SECONDS: since the start)
  tt=${TEST_TIMEOUT:-300}; [ "$left" -lt "$tt" ] && tt=$left
  ts "test timeout ${tt}s"
  (cd /tmp && CONFLUX_GPU_SERVE_MODEL=${TEST_MODEL:-tiny-llama} timeout -k 20 "$tt" \
     python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" -p no:cacheprovider -q -rs -s \
     $(for t in $TESTS; do echo "$REPO/$t"; done) > "$OUT/test_serve_gpu.log" 2>&1)
  t=$?; grep -E "passed|failed|skipped|error|TTFT|^E " "$OUT/test_serve_gpu.log" | tail -20
  ts "tests exit $t"; [ "$t" = 0 ] || [ "$t" = 5 ] || { rc=$t; ray_errors ray-errors-tests.log; }
}

# the estimator profiles a server fits at start are cached here and come back with $OUT
export CONFLUX_CACHE_DIR=${CONFLUX_CACHE_DIR:-$OUT/conflux-cache}
if [ "${TESTS_FIRST:-0}" = 1 ]; then
  [ "${SKIP_TESTS:-0}" = 1 ] || run_tests
  [ "${SKIP_BENCH:-0}" = 1 ] || run_bench
else
  [ "${SKIP_BENCH:-0}" = 1 ] || run_bench
  [ "${SKIP_TESTS:-0}" = 1 ] || run_tests
fi
# the device returns at most 8 files per call: everything but the JSON results goes into one archive
# (the step logs, server and Ray logs; `tar xzf logs.tar.gz` here)
ls -la "$OUT"
(cd "$OUT" && find . -maxdepth 3 -type f ! -name '*.json' ! -name logs.tar.gz ! -name .packed -printf '%P\n' > .packed \
   && tar czf logs.tar.gz -T .packed && xargs -a .packed rm -f && rm -f .packed \
   && find . -mindepth 1 -type d -empty -delete)
exit $rc
