"""Segments and blocks in the layout of PyTorch's memory snapshot
(``torch.cuda.memory._snapshot()``: the ``Segment`` and ``Block`` TypedDicts
of ``torch/cuda/memory.py``), for :meth:`Strategy.memory_segments`."""

from __future__ import annotations

__all__ = ["frames_of", "block", "segment"]


def frames_of(origin) -> list[dict]:
    """An Origin's frames as PyTorch's snapshot writes them."""
    if origin is None:
        return []
    return [{"filename": f, "line": n, "name": fn} for f, n, fn in origin.frames]


def block(ptr: int, size: int, requested: int, active: bool, origin=None) -> dict:
    return {"address": ptr, "size": size, "requested_size": requested if active else 0,
            "state": "active_allocated" if active else "inactive", "frames": frames_of(origin)}


def segment(device: int, address: int, total: int, blocks: list, stream: int = 0) -> dict:
    allocated = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": device, "address": address, "total_size": total, "stream": stream,
            "segment_type": "small" if total <= 1 << 20 else "large", "allocated_size": allocated,
            "active_size": active, "blocks": blocks}
