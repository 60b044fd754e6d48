"""Small host-to-device transfers that do not wait for the device.

[Note: transfers without a wait] A plain copy of a CPU tensor to a GPU (``torch.tensor(values,
device="cuda")``, ``t.to("cuda")``) synchronizes the stream: the host waits until every kernel
queued so far has run, so it cannot queue the next ones meanwhile. A copy from pinned memory with
``non_blocking=True`` is queued like a kernel instead; torch's pinned-memory allocator keeps the
block until the copy has run, so the temporary is safe to drop at once. The rollout engine moves
its token ids, positions and sampling settings this way every step.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, queued without a wait when it goes from the host to a GPU [Note:
    transfers without a wait]; `t` itself when it is there already."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
