"""What a step and its kernels cost on a GPU (``python -m benchmarks.steps``)."""
