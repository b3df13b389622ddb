"""Host <-> device copies of a step's data that never stall the host.

A blocking ``torch.tensor(data, device=cuda)`` (or ``cpu_tensor.to(cuda)``) synchronizes the
stream: the host waits until the GPU has finished everything queued before it, and the GPU then
idles while the host launches the next kernels. Inside a step's layer loop that serializes host
and GPU. These helpers stage the data in pinned host memory and copy asynchronously; the caching
host allocator keeps the pinned block alive until the copy has run.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], device: torch.device,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype)`` on ``device``; asynchronous on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``; asynchronous on CUDA (staged through pinned memory)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host behind the work queued before them: on CUDA into pinned memory with an
    event after the copies, so no stream-wide synchronisation; ``lists()`` waits for those copies only, not
    for work queued on the device after them."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                               for t in tensors)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tuple(tensors)

    def lists(self) -> list:
        """Each tensor's ``tolist()``, once its copy has landed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return [t.tolist() for t in self._host]
