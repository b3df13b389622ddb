#!/usr/bin/env bash
# Builds .gpusite/ (git-ignored) for the GPU machine: what its image lacks, unpacked for CPython 3.12
# x86-64 into one xz archive (site.tar.xz, ~35 MB: the wheels themselves take ~55 MB, which with the
# repository is more than a device call carries), plus the xgrammar wheel and the openai client
# (client.tar.xz). benchmarks/gpu_setup.sh
# unpacks it there. The FlashInfer kernels JIT-compile on the first prefill step of a fresh machine
# (about a minute); to skip that, bring them back once (`tar czf $OUT/fi_cache.tgz -C ~/.cache
# flashinfer`) and put the file in .gpusite/.
#   usage (repository root):  bash benchmarks/build_gpusite.sh
set -euo pipefail
ROOT=$(pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
bash ../shared/gpu/ray-wheels.sh "$tmp/whl"          # Ray 2.60 (trimmed) and Serve's dependencies
PLAT="--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
--platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$tmp/whl" "flashinfer-python==0.5.3" "apache-tvm-ffi==0.1.15.post2"
mkdir -p "$tmp/site" .gpusite
python3 -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" --python-version 3.12 \
  --implementation cp --only-binary=:all: $PLAT "$tmp"/whl/*.whl
# not needed to serve: CUTLASS's tests, examples and Python package; Ray's data, tune, train and llm
rm -rf "$tmp"/site/flashinfer/data/cutlass/{test,examples,python} "$tmp"/site/flashinfer/data/cutlass/tools/{library,profiler}
rm -rf "$tmp"/site/ray/{data,tune,train,llm,rllib}
(cd "$tmp/site" && tar cf - . | xz -T0 -6 > "$ROOT/.gpusite/site.tar.xz")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d .gpusite "xgrammar==0.2.9"
# the official client for the serve tests run there (tests/serve/test_tools_structured.py), 1.1 MB in xz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$tmp/client_whl" "openai==3.63.0" jiter distro httpx httpx2 httpcore httpcore2 anyio sniffio h11 truststore idna
mkdir -p "$tmp/client"
for w in "$tmp"/client_whl/*.whl; do (cd "$tmp/client" && python3 -m zipfile -e "$w" .); done
rm -rf "$tmp/client/bin"
(cd "$tmp/client" && tar cf - . | xz -T0 -9e > "$ROOT/.gpusite/client.tar.xz")
ls -la .gpusite
