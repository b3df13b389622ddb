#!/usr/bin/env bash
# GPU-machine driver for `conflux profile` (run via the device tool): RANKS, KVGB, BUDGET, BATCHES, TMO, OUT from env.
# The GPU image lacks pydantic/gguf (carry .whl/) and the editable install: a PYTHONPATH shim maps the namespace.
set -u
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | tail -2
NS=/tmp/ns; mkdir -p $NS/conflux_cluster; cp -r conflux_cluster/* $NS/conflux_cluster/
for d in engine router actors; do ln -sfn $PWD/$d $NS/conflux_cluster/$d; done
export PYTHONPATH=$NS
cd /tmp  # the repo root on sys.path would shadow the shim's conflux_cluster
P="import sys,argparse; from conflux_cluster.commands import profile as p; ap=argparse.ArgumentParser(); sp=ap.add_subparsers(); p.register(sp); a=ap.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
for N in $RANKS; do
  [ "$N" = 2 ] && [ -n "${EXTRA2:-}" ] && EXTRA="$EXTRA2"
  timeout $TMO python3 -c "$P" profile --model llama-3.1-8b --device cuda --num-ranks $N --kv-cache-memory-gb $KVGB \
     --time-budget $BUDGET --batches $BATCHES --hardware h200 ${EXTRA:-} --raw-out $OUT/raw-llama8b-n$N.json \
     --out $OUT/h200-llama-3.1-8b-n$N.json 2>&1 | tr '\r' '\n' | grep -v '^\(pool\|decode\|prefill\|hetero\) *\[' | tail -20
  echo "exit N=$N: ${PIPESTATUS[0]}"
done
ls -la $OUT
