"""Copies between host and device that do not wait for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronises
the stream: the host waits for every kernel already queued, a whole forward pass in the
engine's asynchronous-output steps, whose point is that the host prepares the next step
meanwhile. Staged in pinned memory (torch's caching host allocator keeps it until the copy
has run), the copy is queued like a kernel instead.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, queued behind the device's work."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy on the host, queued into pinned memory (read it once an event
    recorded after this call has completed); a host tensor itself."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued like :func:`to_device`'s."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
