"""Start a local process group of worker processes (torch.multiprocessing), ports from the OS.

The parent hosts the rendezvous ``TCPStore`` on port 0 (the OS picks a free port), so two
instances on one machine never collide; children connect to it and join the group. The store listens
on 127.0.0.1 only (a group's processes share one machine): torch's own ``TCPStore`` server would
listen on every interface, so it is handed a socket bound to the loopback address.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist

from ..contracts.step import Rendezvous


def host_store(world_size: int, backend: str, timeout_s: float = 300.0) -> tuple[dist.TCPStore, Rendezvous]:
    """Create the rendezvous store in the parent on a free port; keep the store alive while used."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.detach())  # the store owns it now
    return store, Rendezvous("127.0.0.1", port, world_size, backend, timeout_s)


def join_group(rdv: Rendezvous, rank: int) -> None:
    """Called in a child: join the default process group as ``rank``."""
    store = dist.TCPStore(rdv.host, rdv.port, is_master=False, timeout=timedelta(seconds=rdv.timeout_s))
    dist.init_process_group(rdv.backend, store=store, rank=rank, world_size=rdv.world_size,
                            timeout=timedelta(seconds=rdv.timeout_s))


def leave_group(ok: bool = True) -> None:
    """Called in a child before it exits: tear the group down cleanly.

    A process that exits with a live gloo group can abort in the C++ destructor ("terminate called
    without an active exception"). On success, a barrier first, so no peer is still mid-collective.
    """
    if not dist.is_initialized():
        return
    if ok:
        dist.barrier()
    dist.destroy_process_group()


@contextmanager
def leaving_group() -> Iterator[None]:
    """Run a child's work, then ``leave_group`` (with the barrier only if the work succeeded)."""
    ok = False
    try:
        yield
        ok = True
    finally:
        leave_group(ok)
