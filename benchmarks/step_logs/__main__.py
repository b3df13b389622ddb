"""What served step logs (``conflux serve --step-log``) say, on CPU: a subcommand per reading.

    python -m benchmarks.step_logs stats LOG ...                  # prefill speed, decode-step spread
    python -m benchmarks.step_logs estimator LOG --profile P ...  # the estimator's error; --refit
    python -m benchmarks.step_logs refit LOG --profile P ...      # the online refit replayed

``python -m benchmarks.step_logs NAME -h`` gives a subcommand's flags.
"""

import sys

from benchmarks.common import run_subcommand

SUBCOMMANDS = {"stats": "stats", "estimator": "estimator", "refit": "refit"}

if __name__ == "__main__":
    sys.exit(run_subcommand("benchmarks.step_logs", SUBCOMMANDS))
