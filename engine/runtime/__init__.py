"""What runs a step: the rank worker, the executors that drive the ranks (in process, spawned
workers), how a device's worker is built, CUDA graphs and the warm-up that captures them."""
