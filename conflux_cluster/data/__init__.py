"""Data shipped with the package: the Mooncake FAST'25 traces (Apache-2.0, see traces/LICENSE-APACHE)."""

from pathlib import Path

TRACES_DIR = Path(__file__).resolve().parent / "traces"  # mooncake_{synthetic,conversation}_trace.jsonl
MOONCAKE_BLOCK_TOKENS = 512  # tokens per ``hash_ids`` entry of a Mooncake trace line
