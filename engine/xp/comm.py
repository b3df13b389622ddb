"""Collectives XP needs, over a ``torch.distributed`` group (gloo on CPU, NCCL on GPU).

Every message size is computed by both sides from the step plan, so a rank always knows what it
will receive: no size exchange precedes an all-to-all. ``group=None`` with one rank is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class XPGroups:
    """Process groups of one device. World = N logical ranks x k TP devices, world rank = r * k + t.

    ``sp``: the N devices with the same TP index t (Ulysses all-to-all, transition gather).
    ``tp``: the k devices of logical rank r (all-reduce of row-parallel outputs).
    """

    rank: int  # logical rank r
    tp_rank: int  # t
    num_ranks: int  # N
    tp_size: int  # k
    sp: object | None = None  # dist.ProcessGroup or None when N == 1
    tp: object | None = None  # dist.ProcessGroup or None when k == 1

    @classmethod
    def single(cls) -> "XPGroups":
        return cls(0, 0, 1, 1)

    @classmethod
    def create(cls, num_ranks: int, tp_size: int) -> "XPGroups":
        """Build the groups; every process of the world must call this in the same order."""
        world = dist.get_rank()
        r, t = divmod(world, tp_size)
        out = cls(r, t, num_ranks, tp_size)
        for tt in range(tp_size):  # new_group is collective: all processes create every group
            ranks = [rr * tp_size + tt for rr in range(num_ranks)]
            g = dist.new_group(ranks) if num_ranks > 1 else None
            if tt == t:
                out.sp = g
        for rr in range(num_ranks):
            ranks = [rr * tp_size + tt for tt in range(tp_size)]
            g = dist.new_group(ranks) if tp_size > 1 else None
            if rr == r:
                out.tp = g
        return out


def all_to_all_packed(inp: torch.Tensor, send_numels: list[int], recv_numels: list[int], group,
                      async_op: bool = False):
    """Uneven all-to-all of one packed 1-D tensor: its first ``send_numels[0]`` elements go to group
    rank 0, the next ``send_numels[1]`` to rank 1, ...; returns the packed 1-D receive buffer
    (``recv_numels[p]`` elements from each p, in rank order). No copies besides the transfer.
    With ``async_op`` returns ``finish``: waits (the current stream, not the host) and returns it.
    """
    if group is None:
        assert len(send_numels) == 1, "no process group for more than one rank"
        return (lambda: inp) if async_op else inp
    recv = torch.empty(sum(recv_numels), dtype=inp.dtype, device=inp.device)
    work = dist.all_to_all_single(recv, inp, output_split_sizes=list(recv_numels),
                                  input_split_sizes=list(send_numels), group=group, async_op=async_op)
    if not async_op:
        return recv

    def finish() -> torch.Tensor:
        work.wait()
        return recv

    return finish


def all_to_all_flat(send: list[torch.Tensor], recv_numels: list[int], group,
                    async_op: bool = False):
    """Uneven all-to-all of flat tensors: ``send[p]`` goes to group rank p; returns what each p sent.

    ``send[p]``: 1-D, any length (may be 0); ``recv_numels[p]``: length this rank gets from p.
    With ``async_op`` returns ``(work, finish)`` where ``finish()`` waits and returns the list.
    """
    n = len(send)
    if group is None:
        assert n == 1, "no process group for more than one rank"
        out = [send[0]]
        return (None, lambda: out) if async_op else out
    dtype, device = send[0].dtype, send[0].device
    inp = torch.cat(send) if n else torch.empty(0, dtype=dtype, device=device)
    got = all_to_all_packed(inp, [t.numel() for t in send], recv_numels, group, async_op)

    def finish() -> list[torch.Tensor]:
        return list(torch.split(got() if async_op else got, list(recv_numels)))

    return (None, finish) if async_op else finish()


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (no-op without a group)."""
    if group is not None:
        dist.all_reduce(x, group=group)
    return x
