#!/usr/bin/env bash
# Sets everything up, then runs the main job on the embedded default:
# local Ray, one XP instance of 2 CPU ranks serving SmolLM2 on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/conflux serve "$@"
