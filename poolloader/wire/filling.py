"""Collate straight into the slot this worker is filling (the public face is
poolloader.collate: `slot_collate`, `slot_empty`).

The worker loop (poolloader.worker.loop) sets the slot's writer around each fetch
(`set_writer`) and clears it after; `slot_empty` and `slot_collate` take their memory
from it. Outside a PoolLoader worker there is none and they allocate as torch does.
"""
from __future__ import annotations

import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from poolloader.wire.codec import SlotWriter

_writer: SlotWriter | None = None  # set by the worker loop around each fetch


def set_writer(writer: SlotWriter | None) -> None:
    """The writer of the slot being filled (the worker loop, around each fetch), or None."""
    global _writer
    _writer = writer


def slot_empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor inside the slot this worker is filling.

    Called from a collate_fn in a PoolLoader worker it costs no copy later: the
    encoder recognises the memory. Anywhere else (main process, DataLoader, a
    full slot, an unsupported dtype) it is `torch.empty(shape, dtype=dtype)`.
    """
    shape = tuple(shape)
    if _writer is not None and _writer.mapping is not None:
        t = _writer.empty(shape, dtype)
        if t is not None:
            return t
    return torch.empty(shape, dtype=dtype)


def _collate_tensor_into_slot(batch, *, collate_fn_map=None):
    elem = batch[0]
    if _writer is None or elem.is_nested or elem.layout != torch.strided:
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    out = _writer.empty((len(batch), *elem.shape), elem.dtype)
    if out is None:
        out = torch.empty((len(batch), *elem.shape), dtype=elem.dtype)
    return torch.stack(batch, 0, out=out)


slot_collate_fn_map = dict(default_collate_fn_map)
slot_collate_fn_map[torch.Tensor] = _collate_tensor_into_slot


def slot_collate(batch):
    """default_collate, stacking tensors into the current slot (same result)."""
    return collate(batch, collate_fn_map=slot_collate_fn_map)
