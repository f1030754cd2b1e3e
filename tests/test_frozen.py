"""poolloader.frozen: a list or dict of plain values held in one buffer.

The container decodes exactly what it was given (types, bits, structure), behaves as
a list or dict for reading, pickles and copies; a dataset holding one gives
DataLoader's batches through real PoolLoader workers (fork and spawn); and under fork
its workers copy almost nothing of it over an epoch, where a plain list of dicts is
copied page by page (pytorch/pytorch#13246).
"""
from __future__ import annotations

import collections
import copy
import functools
import gc
import math
import os
import pickle
import random
import statistics
import struct

import numpy as np
import pytest
import torch
from compare import assert_same, both_loaders
from loader_datasets import ListDataset
from torch.utils.data import DataLoader

import poolloader
import poolloader.records as records_module
from poolloader import FrozenDict, FrozenList, PoolLoader, frozen
from poolloader.main.memory import read_process

MIB = 1 << 20


def assert_identical(a, b, path="record"):
    """Same types (bool is not int, tuple is not list), same floats bit for bit, same
    dict order, recursively."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if type(a) is float:
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r} (bits)"
    elif type(a) is dict:
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_identical(ka, kb, f"{path} key {ka!r}")
            assert_identical(va, vb, f"{path}[{ka!r}]")
    elif type(a) in (list, tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
FLOATS = [0.0, -0.0, math.inf, -math.inf, math.nan, NAN_PAYLOAD, 5e-324, 1.7976931348623157e308, 0.1]
TEXT = ["", "a", "ünïcödé", "日本語", "🙂 emoji", "\x00nul", "\ud800 lone surrogate"]
INTS = [0, 1, -1, 2**63, -(2**63) - 1, 10**40, -(3**90)]


def plain_value(rng: random.Random, depth: int = 0):
    """A random nested plain value: every held type, nested up to 4 deep."""
    kind = rng.randrange(14 if depth < 4 else 9)
    if kind == 0:
        return rng.choice(INTS + [rng.randrange(-(10**30), 10**30)])
    if kind == 1:
        return rng.choice(FLOATS + [rng.uniform(-1e6, 1e6)])
    if kind == 2:
        return rng.choice(TEXT)
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(6)))
    if kind == 4:
        return rng.choice([True, False])
    if kind == 5:
        return None
    if kind == 6:
        return bytearray(b"\x00\xff")
    if kind == 7:
        return frozenset(rng.sample(range(50), 3))
    if kind == 8:
        return {rng.choice(TEXT), rng.randrange(9)}
    n = rng.randrange(4)
    if kind in (9, 10):
        return [plain_value(rng, depth + 1) for _ in range(n)]
    if kind == 11:
        return tuple(plain_value(rng, depth + 1) for _ in range(n))
    keys = [rng.choice(TEXT), rng.randrange(-5, 5), (1, "t"), None, 2.5, b"k", True]
    return {rng.choice(keys): plain_value(rng, depth + 1) for _ in range(n)}


def annotation(i: int) -> dict:
    return {"file_name": f"train2017/{i * 7919 % 10**12:012d}.jpg", "id": i,
            "bbox": [i * 0.5, 1.25, -0.0, float(i % 7)], "category_id": i % 91, "area": i * 0.25}


# ---------------------------------------------------------------------------
# the container


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_record_decodes_to_what_it_was(seed):
    rng = random.Random(seed)
    records = [plain_value(rng) for _ in range(400)]
    held = frozen(records)
    assert type(held) is FrozenList and len(held) == len(records)
    for i, record in enumerate(records):
        assert_identical(held[i], record, f"[{i}]")
    for i, record in enumerate(held):  # iteration decodes in order
        assert_identical(record, records[i], f"iterated [{i}]")
    kinds = {type(r) for r in records}
    assert {int, float, str, bytes, bool, type(None), list, tuple, dict} <= kinds  # the data covers them


def test_values_that_look_alike_stay_apart():
    records = [True, 1, 1.0, False, 0, -0.0, 0.0, (1, 2), [1, 2], b"a", "a", bytearray(b"a"), None,
               {"k": (1,)}, {"k": [1]}, {1: "int", 2: True}, {True: 1}]
    held = frozen(records)
    for i, record in enumerate(records):
        assert_identical(held[i], record, f"[{i}]")
    assert math.isnan(frozen([math.nan])[0])


def test_indexing_and_slices_behave_as_on_a_list():
    records = [annotation(i) for i in range(37)]
    held = frozen(records)
    for i in range(-37, 37):
        assert held[i] == records[i]
    assert held[np.int64(5)] == records[5]
    for bad in (37, -38, 10**20):
        with pytest.raises(IndexError):
            held[bad]
    with pytest.raises(TypeError):
        held["1"]
    for s in (slice(None), slice(3, 30, 4), slice(-5, None), slice(None, None, -3), slice(40, 50),
              slice(30, 3, -7), slice(-100, 100)):
        assert held[s] == records[s] and type(held[s]) is list
    as_tuple = frozen(tuple(records))
    assert type(as_tuple[2:5]) is tuple and as_tuple[2:5] == tuple(records[2:5])
    assert len(frozen([])) == 0 and list(frozen([])) == [] and frozen([])[:] == []


def test_equality_membership_and_search():
    records = [annotation(i) for i in range(20)]
    held = frozen(records)
    assert held == records and records == held and held == tuple(records)
    assert held == frozen(list(records)) and held != records[:-1] and held != records[::-1]
    assert held != {"a": 1} and held != "text"
    assert records[7] in held and annotation(99) not in held
    assert held.index(records[4]) == 4 and held.count(records[4]) == 1
    assert list(reversed(held)) == records[::-1]
    with pytest.raises(TypeError):
        hash(held)


def test_an_access_is_a_fresh_copy():
    records = [annotation(i) for i in range(3)]
    held = frozen(records)
    first = held[1]
    first["bbox"].append(99.0)
    first["id"] = -1
    assert held[1] == annotation(1) and held[1] is not held[1]
    records[1]["id"] = 1234  # nor does mutating the original afterwards
    assert held[1]["id"] == 1


def test_a_frozen_dict_reads_as_the_dict():
    original = {f"img{i}.jpg": annotation(i) for i in range(300)}
    original.update({7: "seven", b"raw": None, 2.5: [2.5], True: "one", -(10**30): "big", "": ()})
    held = frozen(original)
    assert type(held) is FrozenDict and len(held) == len(original)
    assert held == original and original == held
    assert list(held) == list(original) and list(held.keys()) == list(original.keys())
    assert list(held.items()) == list(original.items()) and list(held.values()) == list(original.values())
    for key, value in original.items():
        assert key in held
        assert_identical(held[key], value, f"[{key!r}]")
    # keys equal in a dict are equal here: True == 1 == 1.0
    assert held[1] == held[1.0] == held[True] == "one"
    assert held[7.0] == "seven" and ("img3.jpg", annotation(3)) in held.items()
    assert held.get("missing") is None and held.get("missing", 5) == 5
    for absent in ("missing", 8, 2.25, b"img1.jpg", math.nan, (1, 2), None):
        assert absent not in held
        with pytest.raises(KeyError):
            held[absent]
    with pytest.raises(TypeError, match="unhashable"):
        held[[1]]
    empty = frozen({})
    assert len(empty) == 0 and empty == {} and "a" not in empty


def test_keys_whose_hashes_collide_are_told_apart(monkeypatch):
    # 64-bit hashes never collide on this data: make them (3 values for 200 keys)
    monkeypatch.setattr(records_module, "_key_hash", lambda key_id: len(key_id) % 3)
    original = {f"k{i}": i for i in range(200)}
    original.update({5: "five", b"k5": "bytes"})
    held = frozen(original)
    assert all(held[key] == value for key, value in original.items())
    assert "k200" not in held and 6 not in held and held[5.0] == "five"


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(protocol):
    rng = random.Random(protocol)
    records = [plain_value(rng) for _ in range(100)]
    for original in (records, tuple(records), {i: r for i, r in enumerate(records)}):
        back = pickle.loads(pickle.dumps(frozen(original), protocol=protocol))
        assert type(back) is type(frozen(original))
        for key, value in (enumerate(original) if type(original) is not dict else original.items()):
            assert_identical(back[key], value, f"[{key!r}]")
    assert type(pickle.loads(pickle.dumps(frozen(tuple(records)), protocol))[:2]) is tuple


def test_the_buffers_can_travel_out_of_band():
    records = [annotation(i) for i in range(1000)]
    held = frozen(records)
    buffers: list = []
    blob = pickle.dumps(held, protocol=5, buffer_callback=buffers.append)
    # the data and the offsets, not one object per record
    assert len(buffers) == 2 and len(blob) < 1000
    assert sum(memoryview(b).nbytes for b in buffers) == held.nbytes
    assert pickle.loads(blob, buffers=buffers) == records
    mapping = frozen({r["file_name"]: r for r in records})
    dict_buffers: list = []
    pickle.dumps(mapping, protocol=5, buffer_callback=dict_buffers.append)
    assert len(dict_buffers) == 6  # keys, values (data, offsets each), hashes, order


def test_deepcopy_and_copy():
    records = [annotation(i) for i in range(50)]
    for held in (frozen(records), frozen({r["id"]: r for r in records})):
        deep = copy.deepcopy(held)
        assert deep == held and deep is not held
        assert copy.copy(held) == held
    deep = copy.deepcopy(frozen(records))
    assert not np.shares_memory(deep.data, frozen(records).data)


def test_the_buffers_are_read_only():
    held = frozen([annotation(0)])
    with pytest.raises(ValueError):
        held.data[0] = 0
    with pytest.raises(TypeError):
        held[0] = {}  # type: ignore[index]


def test_frozen_of_a_frozen_container_is_itself():
    held = frozen([1, 2])
    assert frozen(held) is held
    assert poolloader.frozen is frozen and "frozen" in poolloader.__all__


class Opaque:
    pass


@pytest.mark.parametrize("records, type_name, path", [
    ([1, {"a": [1, np.float64(2.0)]}], "numpy.float64", "[1]['a'][1]"),
    ([{"box": np.zeros(4)}], "numpy.ndarray", "[0]['box']"),
    ([[], [Opaque()]], "test_frozen.Opaque", "[1][0]"),
    ([{"m": collections.OrderedDict(a=1)}], "collections.OrderedDict", "[0]['m']"),
    ([(1, len)], "builtin_function_or_method", "[0][1]"),
    ([{np.int64(3): 1}], "numpy.int64", f"[0] (the key {np.int64(3)!r})"),  # numpy 1: "3"
    ([torch.zeros(2)], "torch.Tensor", "[0]"),
    ({"k": {"deep": [Opaque]}}, "type", "['k']['deep'][0]"),
])
def test_a_value_it_cannot_hold_is_a_type_error_naming_where(records, type_name, path):
    with pytest.raises(TypeError) as info:
        frozen(records)
    message = str(info.value)
    assert f"type {type_name} at {path}:" in message, message
    assert "float(x)" in message  # and how to fix it


@pytest.mark.parametrize("original, fragment", [
    ({(1, 2): 3}, "the key (1, 2) is a tuple"),
    ({None: 3}, "the key None is a NoneType"),
    ({math.nan: 1}, "the key nan"),
    ({np.int64(1): 1}, "is a numpy.int64"),
])
def test_a_dict_key_it_cannot_look_up_is_a_type_error(original, fragment):
    with pytest.raises(TypeError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        frozen(original)


@pytest.mark.parametrize("value", [{1, 2}, "text", 5, np.arange(3), collections.OrderedDict(a=1), iter([1])])
def test_frozen_takes_only_a_list_tuple_or_dict(value):
    with pytest.raises(TypeError, match="frozen\\(\\) takes a list, tuple or dict"):
        frozen(value)


# ---------------------------------------------------------------------------
# in a loader


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataset_holding_a_frozen_list_gives_dataloaders_batches(context):
    records = [annotation(i) for i in range(203)]
    held = frozen(records)

    def make(cls):
        items = records if cls is DataLoader else held
        return cls(ListDataset(items), batch_size=10, shuffle=True, num_workers=2,
                   multiprocessing_context=context, generator=torch.Generator().manual_seed(5))

    ref, got = both_loaders(make)
    assert len(ref) == 21
    assert_same(ref, got)


def _record_start(directory, worker_id):
    """worker_init_fn: this worker's pid and its USS before it reads a sample."""
    with open(os.path.join(directory, str(worker_id)), "w") as f:
        f.write(f"{os.getpid()} {read_process(os.getpid())['uss']}")


class Annotations(torch.utils.data.Dataset):
    """Reads every field of record i."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        return torch.tensor([r["id"], r["category_id"], r["area"], *r["bbox"], len(r["file_name"])])


def _worker_growth(records, directory) -> list[int]:
    """Each forked PoolLoader worker's USS growth over one shuffled epoch over `records`,
    read while main holds the last batch (the workers are done but still alive)."""
    os.makedirs(directory)
    loader = PoolLoader(Annotations(records), batch_size=500, shuffle=True, num_workers=2,
                        multiprocessing_context="fork", timeout=120,
                        worker_init_fn=functools.partial(_record_start, directory))
    it = iter(loader)
    try:
        for _ in range(len(loader)):
            batch = next(it)
        assert batch.shape == (500, 8)
        growth = []
        for worker_id in range(2):
            with open(os.path.join(directory, str(worker_id))) as f:
                pid, start = (int(v) for v in f.read().split())
            figures = read_process(pid)
            assert figures is not None, f"worker {worker_id} (pid {pid}) exited before its memory was read"
            growth.append(figures["uss"] - start)
        return growth
    finally:
        it._shutdown_workers()
        del it


def test_forked_workers_do_not_copy_a_frozen_list(tmp_path):
    n = 150_000
    plain = _worker_growth([annotation(i) for i in range(n)], tmp_path / "plain")
    gc.collect()
    # no list of dicts alive when these workers fork: a collection in a worker (Python
    # 3.14's incremental one runs as the worker allocates) would write its gc headers
    held = _worker_growth(frozen([annotation(i) for i in range(n)]), tmp_path / "frozen")
    # the list of dicts is ~75 MiB of objects, nearly every page of which an epoch's
    # refcount writes copy into each worker; the frozen buffer is only read. Memory,
    # not time: the load on the machine does not move these figures.
    assert statistics.median(plain) > 30 * MIB, [g / MIB for g in plain]
    assert statistics.median(held) < 0.25 * statistics.median(plain), (
        [g / MIB for g in held], [g / MIB for g in plain])
