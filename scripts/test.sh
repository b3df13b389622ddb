#!/usr/bin/env bash
# Sets everything up, then runs the test suite (GPU-only tests skip cleanly on CPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
