"""All of a step's prefill chunks in one paged attention call per layer (FlashInfer, CUDA).

The torch path attends chunk by chunk: for each segment and layer it gathers the segment's whole
history into a contiguous copy, then runs SDPA; a step's cost then grows with its number of chunks.
Here one ``BatchPrefillWithPagedKVCacheWrapper`` call per layer attends every chunk over its KV in
place, in the pool's own layout (NHD pages: ``[num_blocks, tpb, heads, D]``, the prefill view)::

    packed q rows   [ seg 0 rows | seg 1 rows | ... ]            qo_indptr  [0, n0, n0+n1, ...]
    pages           [ seg 0's blocks | seg 1's blocks | ... ]    kv_indptr  (table order, [0, end))
    seg i attends keys [0, end_i): query j at position start_i + j sees keys <= start_i + j
                    (FlashInfer's causal mask is aligned to the bottom right: kv_len - qo_len + j)

The plan (host-side work partition) is built once per step; every layer reuses it. FlashInfer's plan
copies host tensors it makes itself (pageable memory) to the device, and such a copy first waits for
everything queued on its stream: on the step's stream the launch of step k+1 would wait for step k to
end, and the device would then idle while the host launches step k+1's kernels. So the plan runs on a
side stream that holds nothing but a wait for the step that last used the wrapper's buffers, and two
wrappers take turns: step k+1 plans into the buffers step k-1 used, which has been read back by then
(ranks launch at most one step ahead), while step k may still be reading the other's. Each segment's
rows are contiguous in the received array on one SP rank (slices); with several SP ranks they
are gathered into the packed order once per layer (``perm``) and scattered back.

Why FlashInfer: it is the paged varlen prefill library vLLM and SGLang use on Hopper, takes the
pool's page size (16) and layout as they are, and JIT-compiles with the machine's nvcc; FlexAttention
would need 128-token pages to run at its block size, and FlashAttention has no wheel for this torch
(docs/xp.md, "Prefill attention").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..util.transfer import tensor_to_device

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-KV scratch (its examples use 128 MiB)


def available() -> bool:
    """FlashInfer is importable (the GPU machine carries its wheel; CPU installs lack it)."""
    return importlib.util.find_spec("flashinfer") is not None


@dataclass(frozen=True)
class PackedSegments:
    """A step's chunk segments in FlashInfer's packed form (host lists; built once per step)."""

    qo_indptr: list[int]  # [S + 1] query rows of segment i: [qo_indptr[i], qo_indptr[i+1])
    kv_indptr: list[int]  # [S + 1] its pages in ``kv_indices``
    kv_indices: list[int]  # physical block ids, each segment's table order
    last_page_len: list[int]  # [S] keys in each segment's last page (1..tpb)
    perm: list[int] | None  # packed row -> row of the received array; None: identity


def pack_segments(segments: list, tables: list[list[int]], tpb: int) -> PackedSegments:
    """``segments`` (SPSegment: start, end, token_idx) with their block ids ``tables`` (>= end keys)."""
    qo, kv, idx, last, rows = [0], [0], [], [], []
    for seg, blocks in zip(segments, tables):
        n_pages = -(-seg.end // tpb)
        qo.append(qo[-1] + seg.end - seg.start)
        kv.append(kv[-1] + n_pages)
        idx += list(blocks[:n_pages])
        last.append(seg.end - (n_pages - 1) * tpb)
        rows += seg.token_idx.tolist()
    perm = None if rows == list(range(len(rows))) else rows
    return PackedSegments(qo, kv, idx, last, perm)


class PagedPrefill:
    """One FlashInfer wrapper per device: ``plan`` once per step, ``run`` once per layer."""

    def __init__(self, device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 tpb: int, dtype: torch.dtype, scale: float, backend: str = "auto") -> None:
        import flashinfer

        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.tpb, self.dtype, self.scale = tpb, dtype, scale
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # shared: stream-ordered
        # backend "auto": FlashInfer picks FA3 (Hopper) where it supports the shapes, else FA2. Two wrappers
        # (module docstring): each has its own plan buffers, host and device
        self._wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                         backend=backend) for _ in range(2)]
        self._turn = 0  # the wrapper of the step planned last
        self._released: list[torch.cuda.Event | None] = [None, None]  # after the last step that used each
        self._side = torch.cuda.Stream(device=device)
        self._side.wait_stream(torch.cuda.current_stream(device))  # built mid-run: behind what is queued already
        self._perm: torch.Tensor | None = None
        self._rows = 0

    @property
    def _wrapper(self):
        return self._wrappers[self._turn]

    @property
    def backend(self) -> str:
        """The kernel family FlashInfer runs ("fa2", "fa3"; "auto" until the first plan resolves it)."""
        return str(getattr(self._wrapper, "_backend", "auto"))

    def plan(self, packed: PackedSegments) -> None:
        """Partition this step's work into the other wrapper than the last step's, on the side stream (module
        docstring); the step's stream waits for the plan's copies, the host does not."""
        self._turn ^= 1
        i32, dev = torch.int32, self._workspace.device
        step_stream = torch.cuda.current_stream(dev)
        if self._released[self._turn] is not None:
            self._side.wait_event(self._released[self._turn])
        with torch.cuda.stream(self._side):
            self._wrapper.plan(torch.tensor(packed.qo_indptr, dtype=i32), torch.tensor(packed.kv_indptr, dtype=i32),
                               torch.tensor(packed.kv_indices, dtype=i32),
                               torch.tensor(packed.last_page_len, dtype=i32),
                               self.num_q_heads, self.num_kv_heads, self.head_dim, self.tpb, causal=True,
                               sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        step_stream.wait_stream(self._side)
        # staged through pinned memory: a pageable copy would synchronize the stream inside the step's launch
        self._perm = None if packed.perm is None else tensor_to_device(torch.tensor(packed.perm), dev)
        self._rows = packed.qo_indptr[-1]

    def end_step(self) -> None:
        """After the step's last ``run``: the next plan into this wrapper's buffers waits for what is queued now."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._workspace.device))
        self._released[self._turn] = done

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, out: torch.Tensor) -> None:
        """q [T, hq, D] (received rows), pages [num_blocks, tpb, hkv, D] -> out[rows of the segments]."""
        if self._perm is None:
            out[:self._rows] = self._wrapper.run(q[:self._rows], (k_pages, v_pages))
            return
        o = self._wrapper.run(q.index_select(0, self._perm), (k_pages, v_pages))
        out.index_copy_(0, self._perm, o.to(out.dtype))
