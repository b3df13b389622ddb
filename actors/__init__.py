"""Ray actors: one per logical rank, and the XP-instance group. Installed as ``conflux_cluster.actors``."""
