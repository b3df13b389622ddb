#!/usr/bin/env bash
# Source on the GPU machine (device tool, repository root) with `.gpusite` carried: the image has
# torch/Triton/NCCL but not Ray, pydantic, fastapi or FlashInfer. .gpusite/site.tar.xz holds them
# unpacked for CPython 3.12 (Ray 2.60 trimmed, FlashInfer 0.5.3 without CUTLASS's tests/examples,
# apache-tvm-ffi); .gpusite/fi_cache.tgz the FlashInfer kernels JIT-built on an H200 (sm90a), so a
# fresh machine does not compile them again. One xz archive travels in 35 MB where the wheels took
# 55 MB, which with the repository left no room under a call's 64 MiB.
#   build here:  bash benchmarks/build_gpusite.sh
# Then, from the repository root: python3 -m benchmarks.<entry> ... (benchmarks/__init__.py lists them).
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device notes
if [ ! -d /tmp/site/ray ]; then
  mkdir -p /tmp/site && tar xJf .gpusite/site.tar.xz -C /tmp/site
fi
if [ -f .gpusite/client.tar.xz ] && [ ! -d /tmp/site/openai ]; then  # the openai client and its deps
  tar xJf .gpusite/client.tar.xz -C /tmp/site
fi
if [ -f .gpusite/fi_cache.tgz ] && [ ! -d "$HOME/.cache/flashinfer" ]; then
  mkdir -p "$HOME/.cache" && tar xzf .gpusite/fi_cache.tgz -C "$HOME/.cache"
fi
for w in .gpusite/*.whl; do  # extra wheels (e.g. xgrammar for structured outputs)
  [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>&1 | tail -1
done
chmod +x /tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet /tmp/site/bin/* 2>/dev/null
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip-e.log 2>&1 \
  || { echo "pip install -e failed"; tail -5 /tmp/pip-e.log; }
