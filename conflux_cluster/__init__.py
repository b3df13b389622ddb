"""ConfluxServe: SLO-aware LLM serving with Conflux Parallelism on Ray.

Public surface (re-exported here): ``LLM`` and ``SamplingParams`` for offline use.
"""
