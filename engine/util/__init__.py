"""Small helpers that know nothing of models or requests: JSON files, seeds, the user cache folder,
the GC heap freeze, CUDA event timing and non-blocking host -> device copies."""
