"""ConfluxServe engine: models, KV cache, XP execution, rank workers and the per-instance scheduler.

Installed as ``conflux_cluster.engine``. Must not import Ray.
"""
