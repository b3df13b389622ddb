"""The paged KV cache: the per-rank pool and its layout, its size, the prefix cache's blocks and hashes."""
