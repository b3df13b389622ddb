"""The attention seam between the model and the runtime.

The model (``models/transformer.py``) calls, once per layer::

    out = backend(layer_idx, q, k, v, meta)   # q: [T, H_q, D]; k, v: [T, H_kv, D] -> [T, H_q, D]

where ``meta = backend.prepare(spans, num_tokens)`` was built once per forward pass from this
rank's token layout. A rank's T rows are the concatenation of ``RowSpan``s, in any order::

    rows:   0 ........ 5 6 ............ 13 14 15 16
            [ A prefill  ][ B prefill     ][C ][D ][E ]     C, D, E: decode tokens (1 row each)
    A: positions 128..133 (history 0..127 already in A's KV)   B: positions 0..7 (first chunk)

q/k rows are already rotated with their absolute positions. A backend must:
  * store each row's k/v as KV of (request, position), and
  * return, for each row, causal attention over that request's KV for positions ``<= its own``
    (history written in earlier steps + rows of the same span up to itself).

``TorchPagedAttention`` does this on one rank with the paged pool. An XP backend (Ulysses SP)
implements the same two methods: it may all-to-all the prefill rows to head shards, attend over
the head-sharded prefill KV, and all-to-all back, while decode rows attend locally.

Around each step the rank worker brackets the forward pass with the plan hooks, for every backend::

    begin_plan(plan)   prefix cache: free evicted blocks, start hit requests' tables (XP: also
                       allocate the step's KV from the plan, scatter hit prefixes to the SP layout)
    forward            (skipped when this rank has no rows, unless ``needs_forward()``: an XP rank
                       joins every collective)
    end_plan(plan)     cache the plan's inserts (XP: also the prefill -> decode transitions)

``manages_kv``: the backend allocates KV from the plan itself (head-sharded prefill); otherwise the
worker reserves each row's block before the forward pass.

``capture_decode_graphs``: a backend that can run decode-only steps as whole-forward CUDA graphs
returns their runner (engine/xp/decode_graphs.py); ``runner.run(ids, positions)`` gives the step's
hidden states, or None for a step it does not cover (the worker then runs the forward as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..contracts.step import StepPlan


@dataclass(frozen=True)
class RowSpan:
    """Rows ``[row_start, row_end)`` of this rank's batch are tokens at positions
    ``[pos_start, pos_end)`` of ``request_id`` (one row and ``is_decode`` for a decode token)."""

    request_id: str
    row_start: int
    row_end: int
    pos_start: int  # tokens [0, pos_start) of this request already have KV
    pos_end: int
    is_decode: bool

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


class DecodeGraphRunner(Protocol):
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Final hidden states [T, hidden] of this step, or None when the step is not one it covers."""
        ...


class AttentionBackend(Protocol):
    manages_kv: bool  # True: KV is allocated by ``begin_plan`` from the plan, not by the worker

    def capture_decode_graphs(self, model: Any, max_batch: int, max_context: int) -> DecodeGraphRunner | None:
        """Capture whole-forward graphs of decode-only steps now (None: this backend has none)."""
        ...

    def begin_plan(self, plan: StepPlan) -> None: ...

    def end_plan(self, plan: StepPlan) -> None: ...

    def needs_forward(self) -> bool:
        """True: run the forward pass even without rows on this rank (collectives need every rank)."""
        ...

    def check_invariants(self, live_requests: set[str] | None = None) -> None: ...

    def prepare(self, spans: list[RowSpan], num_tokens: int) -> Any:
        """Per-forward metadata (block tables, slots, masks) for ``spans``; KV blocks must exist."""
        ...

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: Any) -> torch.Tensor:
        ...
