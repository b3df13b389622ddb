"""The simulator's benchmarks (CPU, no server): one entry point, a subcommand per question.

    python -m benchmarks.simulator goodput ...      # ConfluxServe vs baselines, paper §8.2 settings
    python -m benchmarks.simulator resimulate ...   # the simulator on the real points of gpu_goodput results
    python -m benchmarks.simulator bound ...        # the goodput no scheduler could exceed on those points

``python -m benchmarks.simulator NAME -h`` gives a subcommand's flags.
"""

import sys

from benchmarks.common import run_subcommand

SUBCOMMANDS = {"goodput": "goodput", "resimulate": "resimulate", "bound": "bound"}

if __name__ == "__main__":
    sys.exit(run_subcommand("benchmarks.simulator", SUBCOMMANDS))
