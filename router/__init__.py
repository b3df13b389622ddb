"""Global routing across XP instances. Installed as ``conflux_cluster.router``. Knows no tensors."""
