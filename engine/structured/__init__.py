"""Grammar-constrained decoding (structured outputs, forced tool calls) with xgrammar.

    spec.py       the contract: what a request's output must match (no torch, crosses processes)
    grammar.py    spec -> xgrammar Grammar (validation at the ingress, compilation on the ranks)
    matchers.py   one rank's compiled-grammar cache and per-request matchers -> token bitmasks
    string_bounds.py  length-bounded strings of a JSON Schema as patterns (works around xgrammar#800)

The sampler (``engine/sampling.py``) applies the bitmask; the rank worker fills it while the
forward runs and advances each matcher with every token the rank learns.
"""
