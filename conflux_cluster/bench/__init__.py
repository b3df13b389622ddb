"""Load generator over the OpenAI HTTP API: workloads, client, vllm-bench-style report."""
