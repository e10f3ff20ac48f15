"""Copies between the host and the device that the host does not wait for: through pinned memory, which
torch's caching host allocator keeps from reuse until the copy is done (a copy from pageable memory may
wait for the device while the driver stages it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor,
    dtype: torch.dtype,
    like: torch.Tensor | torch.device,
) -> torch.Tensor:
    """values (a list, or a tensor on the host) on like's device (or on it, if a device), as dtype."""
    device = like.device if isinstance(like, torch.Tensor) else like
    pinned = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        return (host.pin_memory() if pinned else host).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """Copies of tensors on the host, started without waiting, and the event that marks them done (None on
    the CPU, where they are done already)."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = tuple(
        torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
    )
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
