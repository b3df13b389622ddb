#!/usr/bin/env bash
# Sets everything up, lints (ruff, rules in pyproject.toml [tool.ruff]), then runs the test suite
# (GPU-only tests skip cleanly on CPU machines) in two passes: the modules that can share the machine
# on two pytest-xdist workers (one module per worker at a time), then the ones marked ray_exclusive
# (a Ray that must be the only one on the machine) alone. Exits non-zero if either pass fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# A real Prometheus for tests/ops/test_prometheus.py (Debian package): installed only when missing
# and apt-get is usable as root or via passwordless sudo; otherwise that test skips with a reason.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then as_root=env; elif sudo -n true 2>/dev/null; then as_root="sudo -n"; else as_root=""; fi
  if [ -n "$as_root" ]; then
    { $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
      || { $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }; \
    } >/dev/null 2>&1 || echo "note: could not install prometheus; its test will skip" >&2
  fi
fi
.venv/bin/python -m ruff check --no-cache .   # the lint rules in pyproject.toml [tool.ruff]

# pytest's exit status 5 means "no tests collected" (arguments that select only one pass's tests):
# a failure only when neither pass ran anything.
shared=0; alone=0
.venv/bin/python -m pytest -q --durations=25 -n 2 --dist loadfile -m "not ray_exclusive" "$@" || shared=$?
.venv/bin/python -m pytest -q --durations=25 -m ray_exclusive "$@" || alone=$?
echo "pytest exit status: shared pass $shared, ray_exclusive pass $alone"
for rc in "$shared" "$alone"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
if [ "$shared" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
