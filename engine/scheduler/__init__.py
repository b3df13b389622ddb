"""Per-instance scheduler (paper §6.2-6.4, Alg. 1-4): pure Python over plain data, no tensors, no Ray.

The engine and the simulator drive the very same ``Scheduler``.
"""
