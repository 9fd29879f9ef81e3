"""Host values to the device without waiting for the device.

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


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued like :func:`to_device`'s."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
