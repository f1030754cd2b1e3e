"""Collate straight into the slot being filled.

`slot_collate` is torch's own `collate` machinery (default_collate's rules for
numbers, strings, mappings, namedtuples, sequences, numpy) with one rule
changed: tensors are stacked into memory allocated from the current slot, so a
batch's bytes are written once. Outside a PoolLoader worker, or when the slot is
full, it allocates as torch does; the result is the same either way.

`slot_empty` is the public allocator for custom collates that want the same
zero-copy path.

This is the public face; the code is poolloader.wire.filling, where the worker loop
(which sets the slot being filled) reaches it without importing upward.
"""
from __future__ import annotations

from poolloader.wire.filling import slot_collate, slot_collate_fn_map, slot_empty

__all__ = ["slot_collate", "slot_collate_fn_map", "slot_empty"]
