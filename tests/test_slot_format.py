"""slot_format on its own: the header protocol and the batch codec, over a real
shared-memory segment of a real pool (no worker process needed)."""
from __future__ import annotations

import collections
import gc
import io
import pickle
import warnings
import zlib

import numpy as np
import pytest
import torch

from poolloader.detection import pack_targets
from poolloader.errors import SlotCorrupt
from poolloader.shm.pool import SlotPool
from poolloader.wire import codec
from poolloader.wire import slot_format as fmt

Pair = collections.namedtuple("Pair", "a b")


@pytest.fixture
def slot():
    pool = SlotPool(num_workers=1, slots=1, max_slots=1, slot_bytes=2 << 20)
    mapping = pool.mappings[0]
    try:
        yield mapping, fmt.header_view(mapping)
    finally:
        gc.collect()
        pool.close()


def encode(mapping, header, payload, status=fmt.ST_READY):
    writer = codec.SlotWriter()
    writer.begin(mapping)
    codec.encode(writer, header, payload, status)
    writer.end()


def _same(a, b) -> bool:
    """Equal, with the same types throughout (1 == True == np.int64(1), but not here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _round_trip(mapping, header, index, int_list):
    request = fmt.encode_request(index, int_list)
    assert (fmt.request_slot_bytes(request) == 0) == (len(request) <= fmt.REQUEST_MAX)
    fmt.write_request(mapping, header, seq=7, epoch=2, worker=1, request=request)
    assert fmt.request_epoch(header) == 2
    # every field the worker reads and echoes (written in one struct call)
    assert [int(header[f]) for f in (fmt.F_MAGIC, fmt.F_STATUS, fmt.F_SEQ, fmt.F_WORKER,
                                     fmt.F_REQUEST_LEN, fmt.F_SHARED_SEED)] == \
        [fmt.SLOT_MAGIC, fmt.ST_REQUESTED, 7, 1, len(request), 0]
    got = fmt.read_request(mapping, header)
    assert _same(got, index), (index, got)
    return request.startswith(fmt.INT64_REQUEST)


def test_requests_small_and_large_round_trip_with_their_types(slot):
    mapping, header = slot
    # a list of Python ints the caller vouches for (torch's samplers): raw int64
    for index in ([1, 2, 3], list(range(40_000)), [], [-(1 << 63), (1 << 63) - 1]):
        assert _round_trip(mapping, header, index, int_list=True)
        assert not _round_trip(mapping, header, index, int_list=False)
    # an int past int64 falls back to pickle; so does anything that is not a list
    assert not _round_trip(mapping, header, [1 << 63, 2], int_list=True)
    for index in ((1, 2), 7, "key", {"a": [1]}):
        assert not _round_trip(mapping, header, index, int_list=True)
    # other element types: pickled unless vouched for (the iterator vouches only for
    # torch's samplers), and they come back as they went
    for index in ([True, 1], [np.int64(3), 4], [1.0, 2], [[1], 2]):
        assert not _round_trip(mapping, header, index, int_list=False)


def test_a_moved_request_reads_as_written_and_ring_values_carry_slot_and_ticket():
    """copy_request (main moving a request before its worker starts on it) gives the
    target slot the same request, small or large (at DATA_OFF), with the fields the
    worker echoes and the shared seed; a ring value splits back into slot and ticket."""
    pool = SlotPool(num_workers=1, slots=2, max_slots=2, slot_bytes=2 << 20)
    try:
        (a, b) = pool.mappings
        ha, hb = fmt.header_view(a), fmt.header_view(b)
        for index in ([5, 6, 7], list(range(40_000)), {"key": (1, 2)}):
            request = fmt.encode_request(index, isinstance(index, list))
            fmt.write_request(a, ha, seq=9, epoch=3, worker=2, request=request, shared_seed=77)
            fmt.copy_request(a, ha, b, hb)
            assert _same(fmt.read_request(b, hb), index)
            assert [int(hb[f]) for f in (fmt.F_MAGIC, fmt.F_STATUS, fmt.F_SEQ, fmt.F_EPOCH,
                                         fmt.F_WORKER, fmt.F_SHARED_SEED)] == \
                [fmt.SLOT_MAGIC, fmt.ST_REQUESTED, 9, 3, 2, 77]
        del ha, hb, a, b
    finally:
        gc.collect()
        pool.close()
    for slot, ticket in ((0, 1), (fmt.MAX_SLOTS - 1, fmt.TICKET_LIMIT - 1), (17, 123456789)):
        value = fmt.ring_value(slot, ticket)
        assert 0 <= value < 1 << 63 and fmt.ring_entry(value) == (slot, ticket)
    assert fmt.ring_entry(-5) == (-5, 0)  # a stray write: refused by the slot's bounds check


def test_reply_must_echo_batch_and_worker(slot):
    mapping, header = slot
    fmt.write_request(mapping, header, seq=7, epoch=0, worker=1, request=fmt.encode_request([0]))
    encode(mapping, header, torch.zeros(2))
    assert fmt.reply_status(header, 0, seq=7, worker=1) == fmt.ST_READY
    with pytest.raises(SlotCorrupt, match="not the reply to batch 8"):
        fmt.reply_status(header, 0, seq=8, worker=1)
    with pytest.raises(SlotCorrupt):
        fmt.reply_status(header, 0, seq=7, worker=0)
    fmt.mark_grow(header, 5 << 20)
    assert fmt.reply_status(header, 0, 7, 1) == fmt.ST_GROW and fmt.needed_bytes(header) == 5 << 20
    fmt.mark_end(header)
    assert fmt.reply_status(header, 0, 7, 1) == fmt.ST_END


def test_small_tensors_are_copied_out_and_large_ones_own_their_storage(slot):
    mapping, header = slot
    big = torch.arange(100_000, dtype=torch.float32).view(100, 1000)
    batch = {"image": big, "t": big.t(), "labels": torch.tensor([3, 1, 4]),
             "boxes": torch.rand(5, 4), "arr": np.arange(6).reshape(2, 3),
             "big_arr": np.ones((300, 300), np.float32), "name": "x"}
    encode(mapping, header, batch)
    got, lease = codec.decode(mapping, header)
    for key in ("image", "t", "labels", "boxes"):
        assert torch.equal(got[key], batch[key]) and got[key].stride() == batch[key].stride()
    np.testing.assert_array_equal(got["arr"], batch["arr"])
    np.testing.assert_array_equal(got["big_arr"], batch["big_arr"])
    lo, hi = mapping.address, mapping.address + mapping.size
    for key in ("image", "t"):  # in the slot, one storage each over exactly its span
        ptr = got[key].untyped_storage().data_ptr()
        assert lo <= ptr < hi and got[key].untyped_storage().nbytes() == big.nbytes
    for key in ("labels", "boxes"):  # private, one small buffer per batch
        assert not lo <= got[key].data_ptr() < hi
    assert got["labels"].untyped_storage().data_ptr() == got["boxes"].untyped_storage().data_ptr()
    assert lease is not None and mapping.leases == 1
    del got, lease
    gc.collect()
    assert mapping.leases == 0


def test_the_small_block_copy_is_the_same_from_a_mapping_or_any_buffer(slot):
    """copy_small copies a Mapping's bytes with one memmove and any other buffer through
    numpy: the same bytes, at an odd offset and length, into a private tensor."""
    mapping, _header = slot
    off, n = fmt.DATA_OFF + 64 * 3, 1000 + 7
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    np.frombuffer(mapping, np.uint8, count=n, offset=off)[:] = data
    plain = bytearray(bytes(memoryview(mapping)[:off + n]))
    for source in (mapping, plain):
        small = codec.copy_small(source, off, n)
        assert small.dtype == torch.uint8 and small.numel() == n
        assert bytes(small.numpy()) == data.tobytes()
        lo = mapping.address
        assert not lo <= small.data_ptr() < lo + mapping.size


def test_a_batch_of_small_tensors_keeps_no_lease(slot):
    mapping, header = slot
    encode(mapping, header, [torch.arange(10), np.zeros(3)])
    got, lease = codec.decode(mapping, header)
    assert lease is None and mapping.leases == 0
    assert got[0].tolist() == list(range(10))


def test_small_budget_per_batch_keeps_the_rest_in_the_slot(slot):
    mapping, header = slot
    n = fmt.SMALL_BATCH_BYTES // fmt.SMALL_TENSOR_BYTES + 4
    batch = [torch.full((fmt.SMALL_TENSOR_BYTES // 4,), float(i)) for i in range(n)]
    pool = SlotPool(num_workers=1, slots=1, max_slots=1, slot_bytes=4 << 20)
    try:
        mapping = pool.mappings[0]
        header = fmt.header_view(mapping)
        encode(mapping, header, batch)
        got, lease = codec.decode(mapping, header)
        assert all(torch.equal(a, b) for a, b in zip(got, batch))
        in_slot = sum(mapping.address <= t.data_ptr() < mapping.address + mapping.size for t in got)
        assert in_slot == 4 and lease is not None
        del got, lease, header
    finally:
        gc.collect()
        pool.close()


def test_fallbacks_round_trip_losslessly(slot):
    mapping, header = slot
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,))
    grad = torch.ones(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
        batch = {"sparse": sparse, "grad": grad, "nested": nested, "obj": np.array([{}, 1], object),
                 "tuple": Pair(1, torch.ones(1))}
        encode(mapping, header, batch)
        got, _ = codec.decode(mapping, header)
    assert torch.equal(got["sparse"].to_dense(), sparse.to_dense())
    assert got["grad"].requires_grad and torch.equal(got["grad"], grad)
    assert got["nested"].is_nested and [t.tolist() for t in got["nested"].unbind()] == [[1, 1], [0, 0, 0]]
    assert list(got["obj"]) == [{}, 1] and got["tuple"].a == 1
    assert pickle.loads(pickle.dumps(got["tuple"])).a == 1


def test_a_payload_that_does_not_fit_reports_the_size_it_needs(slot):
    mapping, header = slot
    with pytest.raises(codec.NeedsGrow) as grow:
        encode(mapping, header, torch.zeros(1 << 20))  # 4 MiB into 2 MiB
    assert grow.value.needed > 4 << 20


def test_corrupt_header_is_an_error_and_gives_the_slot_back(slot):
    mapping, header = slot
    encode(mapping, header, torch.zeros(100_000))
    registry, released = {}, collections.deque()
    header[fmt.F_SKELETON_LEN] = mapping.size * 2
    with pytest.raises(SlotCorrupt, match="out of bounds"):
        codec.decode(mapping, header, registry, released.append, "slot0")
    gc.collect()
    assert len(released) == 1 and registry[released[0]] == "slot0"


def test_writer_warns_when_a_slot_tensor_outlives_its_batch(slot):
    mapping, header = slot
    writer = codec.SlotWriter()
    writer.begin(mapping, 0)
    kept = writer.empty((4,), torch.float32)
    codec.encode(writer, header, kept, fmt.ST_READY)
    writer.end()
    with pytest.warns(RuntimeWarning, match=r"clone\(\)"):
        writer.begin(mapping, 0)
    writer.end()
    del kept
    other = codec.SlotWriter()
    other.begin(mapping, 0)
    other.end()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.begin(mapping, 0)  # nothing kept: no warning
    other.end()


class _Pid:
    def __init__(self, value):
        self.value = value


def rewrite_persistent_ids(mapping, header, change) -> None:
    """Re-pickle the slot's skeleton with every persistent id passed through `change`,
    with a consistent checksum: what a stray write the checksum cannot see would give."""
    off, n = int(header[fmt.F_SKELETON_OFF]), int(header[fmt.F_SKELETON_LEN])

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid):
            return _Pid(change(pid))

    class Writer(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.value if type(obj) is _Pid else None

    payload = Reader(io.BytesIO(bytes(memoryview(mapping)[off:off + n]))).load()
    buf = io.BytesIO()
    Writer(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    blob = buf.getvalue()
    memoryview(mapping)[off:off + len(blob)] = blob
    header[fmt.F_SKELETON_LEN] = len(blob)
    header[fmt.F_SKELETON_CRC] = zlib.crc32(blob)


def test_a_zero_count_with_a_nonempty_shape_is_refused(slot):
    """A tensor id's count bounds its view by the slot; a count of 0 (an empty tensor)
    has nothing in the slot to bound it, so its shape must hold no element: a corrupt
    one is an error, never an allocation of the size it claims (it was 1 GiB here)."""
    mapping, header = slot
    encode(mapping, header, {"big": torch.ones(100_000), "empty": torch.ones(0, 100_000)})

    changed = []

    def zero_count(pid):
        if pid[0] != codec.PID_TENSOR:
            return pid  # the empty tensor: a small-block id
        kind, code, off, shape, stride, count = pid
        changed.append(pid)
        return (kind, code, off, (1 << 28,), (1,), 0)  # 1 GiB of float32, count 0
    payload, lease = codec.decode(mapping, header)  # the honest slot decodes as it was
    assert payload["empty"].shape == (0, 100_000) and torch.equal(payload["big"], torch.ones(100_000))
    del payload, lease
    rewrite_persistent_ids(mapping, header, zero_count)
    assert len(changed) == 1
    with pytest.raises(SlotCorrupt, match="0 elements"):
        codec.decode(mapping, header)


def test_a_batch_of_only_empty_small_tensors_decodes(slot):
    """Every small tensor empty: the small block has 0 bytes (none is copied), and
    each empty tensor and array still comes back with its shape and dtype."""
    mapping, header = slot
    batch = {"boxes": torch.empty(40_960, 0), "ids": torch.empty(0, dtype=torch.int64),
             "array": np.empty((0, 3), np.float32), "name": "x"}
    encode(mapping, header, batch)
    assert int(header[fmt.F_SMALL_LEN]) == 0
    payload, lease = codec.decode(mapping, header)
    assert lease is None
    assert payload["boxes"].shape == (40_960, 0) and payload["boxes"].dtype == torch.float32
    assert payload["ids"].shape == (0,) and payload["ids"].dtype == torch.int64
    assert payload["array"].shape == (0, 3) and payload["array"].dtype == np.float32
    assert payload["name"] == "x"


Pair = collections.namedtuple("Pair", "a b")


def _plain_fields():
    return {"boxes": torch.rand(3, 4), "labels": torch.arange(3), "big": torch.ones(40_000),
            "ids": np.arange(4), "name": "a", "n": 1.5, "flags": (True, None, b"x")}


@pytest.mark.parametrize("payload,untracked", [
    (_plain_fields(), True),
    ([_plain_fields(), [1, {2}, frozenset({3})], bytearray(b"z")], True),
    (pack_targets([{"boxes": torch.rand(2, 4), "labels": torch.arange(2)},
                   {"boxes": torch.rand(0, 4), "labels": torch.arange(0)}]), True),
    (collections.OrderedDict(_plain_fields()), False),  # a dict subclass: named
    (Pair(torch.ones(2), 1), False),
    ({"x": torch.ones(2, requires_grad=True)}, False),  # torch's own reducer
    ({"x": np.array([1, "a"], dtype=object)}, False),  # numpy's own reducer
    ({"x": torch.ones(2), "f": torch.float32}, False),  # a global by itself
    ({"x": torch.ones(2), "c": 1j}, False),  # complex pickles by builtins.complex
    ({"size": 16, "boxes": [3, 0, 7]}, False),  # no tensor: nothing to keep untracked
    ({"a": np.arange(3), "b": np.ones((2, 2))}, False),  # arrays alone: autograd sees none
], ids=["dict", "containers", "packed", "ordered", "namedtuple", "grad", "object", "dtype", "complex",
        "no-tensor", "arrays"])
def test_a_skeleton_is_marked_untracked_only_when_it_names_no_global_but_allowed_ones(
        slot, payload, untracked):
    """Main makes a batch's tensors outside autograd's view tracking only when the
    worker pickled nothing that names a global but PackedTargets' rebuild: plain
    containers, numbers, strings, tensors and arrays. A batch without a tensor is not
    marked (its load needs neither the guard nor the collector held off). Every batch
    decodes the same."""
    mapping, header = slot
    encode(mapping, header, payload)
    off, n = int(header[fmt.F_SKELETON_OFF]), int(header[fmt.F_SKELETON_LEN])
    flags = codec.skeleton_flags(bytes(memoryview(mapping)[off:off + n]))
    assert flags == (codec.VIEWS_UNTRACKED if untracked else 0)
    got, lease = codec.decode(mapping, header)
    assert repr(got) == repr(payload)
    views = [t for t in (got.values() if isinstance(got, dict) else ()) if isinstance(t, torch.Tensor)]
    assert all(t._is_view() is not untracked for t in views if not t.requires_grad)
    del got, lease, views


@pytest.mark.parametrize("container", [dict, collections.OrderedDict], ids=["marked", "named"])
def test_a_tensor_the_batch_holds_twice_decodes_as_one_object(slot, container):
    """As DataLoader's: one tensor (or array) held in two places of a batch, small or
    large, is one object after decoding, marked skeleton or not, so an in-place write
    through one place is the other's, and autograd sees it (one version counter). Two
    distinct tensors or arrays with equal bytes stay two."""
    mapping, header = slot
    small, large = torch.arange(6), torch.ones(40_000)
    arrays = np.arange(3), np.ones(40_000)
    payload = container(s1=small, s2=small, l1=large, l2=large, twin=torch.arange(6),
                        nested=[small, (large,)], a=arrays, b=arrays[::-1],
                        twin_array=np.arange(3))
    encode(mapping, header, payload)
    off, n = int(header[fmt.F_SKELETON_OFF]), int(header[fmt.F_SKELETON_LEN])
    assert codec.skeleton_flags(bytes(memoryview(mapping)[off:off + n])) & codec.TENSOR_REPEATED
    got, lease = codec.decode(mapping, header)
    assert got["s1"] is got["s2"] is got["nested"][0]
    assert got["l1"] is got["l2"] is got["nested"][1][0]
    assert got["twin"] is not got["s1"] and torch.equal(got["twin"], got["s1"])
    assert got["a"][0] is got["b"][1] and got["a"][1] is got["b"][0]
    assert got["twin_array"] is not got["a"][0]
    w = torch.ones(6, requires_grad=True)
    loss = (w * got["s1"]).sum()
    got["s2"].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    del got, lease, loss


def test_the_collector_never_runs_inside_a_decode_below_view_tracking(slot):
    """Only the unpickler's own code runs below view tracking: the cyclic collector,
    which would run other objects' finalisers (and gc callbacks) inside the load, is
    held off until it ends. Here it would run at nearly every allocation; a callback
    records whether a view made at each collection is tracked."""
    mapping, header = slot
    encode(mapping, header, _plain_fields())
    tracked = []

    def record(phase, info):
        if phase == "start":
            tracked.append(torch.ones(4)[1:]._is_view())

    threshold = gc.get_threshold()
    gc.callbacks.append(record)
    try:
        gc.set_threshold(1)
        for _ in range(20):
            got, lease = codec.decode(mapping, header)
            del got, lease
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(record)
    assert len(tracked) >= 20 and all(tracked)
    assert gc.isenabled()


def test_an_interrupt_as_the_collector_is_held_off_leaves_it_on(slot, monkeypatch):
    """A KeyboardInterrupt raised right after the decode switched the collector off
    (as a signal handler may, when that C call returns) turns it back on."""
    mapping, header = slot
    encode(mapping, header, _plain_fields())

    class InterruptedCollector:
        isenabled, enable = staticmethod(gc.isenabled), staticmethod(gc.enable)

        @staticmethod
        def disable():
            gc.disable()
            raise KeyboardInterrupt

    monkeypatch.setattr(codec, "gc", InterruptedCollector)
    try:
        with pytest.raises(KeyboardInterrupt):
            codec.decode(mapping, header)
        assert gc.isenabled()
    finally:
        gc.enable()
