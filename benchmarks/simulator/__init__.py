"""The simulator's benchmarks, CPU only (``python -m benchmarks.simulator``)."""
