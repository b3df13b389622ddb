"""What served step logs say, CPU only (``python -m benchmarks.step_logs``)."""
