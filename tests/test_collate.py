"""collate.py on its own: slot_collate is default_collate with tensors stacked into
the slot being filled; slot_empty is the public allocator."""
from __future__ import annotations

import gc

import loader_datasets as ds
import numpy as np
import torch
from compare import assert_same
from torch.utils.data import default_collate

from poolloader import slot_collate, slot_empty
from poolloader.shm.pool import SlotPool
from poolloader.wire import codec, filling
from poolloader.wire import slot_format as fmt


def inside(t: torch.Tensor, mapping) -> bool:
    return mapping.address <= t.data_ptr() < mapping.address + mapping.size


def test_outside_a_worker_it_is_default_collate():
    samples = [ds.AugmentDataset()[i] for i in range(4)]
    assert_same(slot_collate(samples), default_collate(samples))
    t = slot_empty((2, 3), torch.int16)
    assert t.shape == (2, 3) and t.dtype == torch.int16


def test_in_a_worker_tensors_are_stacked_into_the_slot_and_not_copied_again():
    pool = SlotPool(num_workers=1, slots=1, max_slots=1, slot_bytes=1 << 20)
    mapping = pool.mappings[0]
    header = fmt.header_view(mapping)
    writer = codec.SlotWriter()
    try:
        samples = [(torch.full((100, 200), float(i)), np.arange(3) + i, i) for i in range(5)]
        writer.begin(mapping)
        filling.set_writer(writer)
        try:
            batch = slot_collate(samples)
            extra = slot_empty((7,), torch.float64)
        finally:
            filling.set_writer(None)
        assert_same(batch, default_collate(samples))
        assert inside(batch[0], mapping) and inside(extra, mapping)
        used = writer.cursor
        codec.encode(writer, header, batch[0], fmt.ST_READY)  # already in the slot: no new bytes
        assert int(header[fmt.F_DATA_LEN]) == fmt.align64(used) - fmt.DATA_OFF
        writer.end()
        got, lease = codec.decode(mapping, header)
        assert torch.equal(got, batch[0]) and got.data_ptr() == batch[0].data_ptr()
        del got, lease, batch, extra
    finally:
        del header
        gc.collect()
        pool.close()
