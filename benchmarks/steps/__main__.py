"""What a step and its kernels cost: one entry point, a subcommand per measurement.

    python -m benchmarks.steps trace ...            # a burst step by step, the offline engine
    python -m benchmarks.steps buckets ...          # decode-only step time by CUDA-graph bucket
    python -m benchmarks.steps chunks ...           # a step as its prefill splits into chunks
    python -m benchmarks.steps xp ...               # XP attention and steps on 1-2 GPUs (paper figures)
    python -m benchmarks.steps decode-kernel ...    # Triton paged decode launch shapes
    python -m benchmarks.steps prefill-history ...  # a prefill chunk over a long history, one layer
    python -m benchmarks.steps gemv ...             # the linear layers at decode batch sizes

``python -m benchmarks.steps NAME -h`` gives a subcommand's flags.
"""

import sys

from benchmarks.common import run_subcommand

SUBCOMMANDS = {"trace": "trace", "buckets": "buckets", "chunks": "chunks", "xp": "xp",
               "decode-kernel": "decode_kernel", "prefill-history": "prefill_history",
               "gemv": "gemv"}

if __name__ == "__main__":
    sys.exit(run_subcommand("benchmarks.steps", SUBCOMMANDS))
