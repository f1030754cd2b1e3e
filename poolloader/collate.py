"""Collate straight into the slot being filled.

`slot_collate` is torch's own `collate` machinery (default_collate's rules for
numbers, strings, mappings, namedtuples, sequences, numpy) with one rule
changed: tensors are stacked into memory allocated from the current slot, so a
batch's bytes are written once. Outside a PoolLoader worker, or when the slot is
full, it allocates as torch does; the result is the same either way.

`slot_empty` is the public allocator for custom collates that want the same
zero-copy path.
"""
from __future__ import annotations

import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from poolloader.wire.codec import SlotWriter

_writer: SlotWriter | None = None  # set by the worker loop around each fetch


def _set_writer(writer: SlotWriter | None) -> None:
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
