#!/usr/bin/env bash
# Source on the GPU machine (device tool, repository root): the image has torch/Triton/NCCL but not
# pydantic/gguf (carried as wheels in .whl/) nor this package, so a PYTHONPATH shim maps the
# conflux_cluster namespace (engine/, router/, actors/ inside it, as setup.py does). NVLink
# multicast stays off (device notes). Then run pytest from /tmp so the repo root does not shadow it:
#   (cd /tmp && python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/xp/...")
# Benchmarks run from the repository root as `python3 -m benchmarks.<entry>`: PYTHONSAFEPATH keeps the
# current directory off sys.path (its conflux_cluster/ would shadow the shim's), $REPO after the shim
# makes the benchmarks package importable.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export REPO=$PWD
python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | tail -2
NS=/tmp/ns
mkdir -p $NS/conflux_cluster
cp -r conflux_cluster/* $NS/conflux_cluster/
for d in engine router actors; do ln -sfn "$REPO/$d" "$NS/conflux_cluster/$d"; done
export PYTHONSAFEPATH=1 PYTHONPATH=$NS:$REPO
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
