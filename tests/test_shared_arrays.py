"""The start-up payload's arrays cross once and are shared (poolloader.main.startup,
poolloader.worker.startup): under spawn and forkserver every numpy array and CPU
tensor storage of at least OUT_OF_BAND_BYTES in the dataset, worker_init_fn and
collate_fn travels out of band in main's start-up memfd, which each worker maps
copy-on-write. Batches stay DataLoader's; a worker's write stays its own; the
workers map one inode, privately, and share its pages; every kind of array and
tensor comes back as plain pickling would give it."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import random

import numpy as np
import pytest
import torch
from compare import assert_same, both_loaders
from torch.utils.data import Dataset, get_worker_info

from poolloader import PoolLoader
from poolloader.worker.startup import OUT_OF_BAND_BYTES

METHODS = ["spawn", "forkserver"]
TIMEOUT = 60  # seconds a batch may take (spawned workers import torch under load)


class Arrays(Dataset):
    """A few MB of numpy array and CPU tensor, read at random offsets with random
    augmentation from all three generators."""

    def __init__(self, n: int = 24):
        rng = np.random.default_rng(5)
        self.n = n
        self.images = rng.random((64, 96, 97), dtype=np.float32)  # 2.4 MB
        self.table = torch.from_numpy(rng.integers(0, 1 << 30, (40, 12345)))  # 3.9 MB
        self.rows = self.table[3:37]  # a view of the same storage

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = random.randrange(len(self.images))
        image = torch.from_numpy(self.images[k] * np.float32(np.random.rand()))
        row = self.rows[int(torch.randint(0, len(self.rows), ()))]
        start = int(torch.randint(0, row.numel() - 7, ()))
        return image + torch.rand(image.shape), row[start:start + 7].clone(), i


def loader(cls, dataset, method, **options):
    return cls(dataset, batch_size=4, num_workers=2, shuffle=True, timeout=TIMEOUT,
               multiprocessing_context=multiprocessing.get_context(method), **options)


@pytest.mark.parametrize("method", METHODS + ["fork"])
def test_batches_are_dataloader_s_bit_for_bit(method):
    dataset = Arrays()
    out_of_band = []

    def epoch(loader):
        it = iter(loader)
        if isinstance(loader, PoolLoader) and method != "fork":  # before any worker replied
            assert it._shared_start is not None
            out_of_band.append(it._shared_start.out_of_band)
        return list(it)

    theirs, ours = both_loaders(lambda cls: loader(cls, dataset, method), run=epoch)
    assert len(ours) == 6
    assert_same(ours, theirs)
    if method != "fork":  # the arrays went out of band: both storages, one per storage
        assert out_of_band == [dataset.images.nbytes + dataset.table.numel() * 8]


class Writes(Dataset):
    """Each item reports what the worker sees at the first two places of its array and
    tensor, then writes its worker id + 1 at its own place: a write must stay in the
    worker that made it."""

    def __init__(self):
        self.array = np.zeros(1 << 18)  # 2 MiB
        self.tensor = torch.zeros(1 << 18, dtype=torch.float64)

    def __len__(self):
        return 16

    def __getitem__(self, i):
        w = get_worker_info().id
        seen = torch.tensor([*self.array[:2], *self.tensor[:2].tolist()])
        self.array[w] = w + 1
        self.tensor[w] = w + 1
        return seen, w


def test_a_write_into_a_shared_array_stays_in_its_worker():
    """Under forkserver only: spawn's workers map the start-up memfd through the same
    start-up code (the other tests here run both)."""
    dataset = Writes()
    pool = PoolLoader(dataset, batch_size=None, num_workers=2, timeout=TIMEOUT,
                      multiprocessing_context=multiprocessing.get_context("forkserver"))
    for epoch in range(2):  # the second epoch's fresh workers see no earlier write
        items = list(pool)
        assert [w for _, w in items] == [0, 1] * 8
        for k, (seen, w) in enumerate(items):
            own = [0.0, 0.0]
            if k >= 2:  # its first item wrote; the other worker's writes never show
                own[w] = w + 1.0
            assert seen.tolist() == own + own, (epoch, k, w, seen)
    assert not dataset.array.any() and not dataset.tensor.any()  # nor in main


def _start_mappings(pid):
    """{(perms, inode): smaps fields in kB} of the process's mappings of a start-up memfd."""
    found, current = {}, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = None
                if len(fields) >= 6 and fields[5].startswith("/memfd:poolloader-start"):
                    current = found.setdefault((fields[1], int(fields[4])), {})
            elif current is not None and fields[0].endswith(":") and len(fields) == 3:
                current[fields[0][:-1]] = current.get(fields[0][:-1], 0) + int(fields[1])
    return found


class Touches(Dataset):
    """Reads every page of its array (the sum), so each worker maps all of it."""

    def __init__(self):
        self.array = np.arange(1 << 20, dtype=np.float64)  # 8 MiB

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return float(self.array.sum()) + i


@pytest.mark.parametrize("method", METHODS)
def test_workers_map_one_memfd_privately_and_share_its_pages(method):
    dataset = Touches()
    pool = PoolLoader(dataset, batch_size=None, num_workers=2, timeout=TIMEOUT,
                      persistent_workers=True,
                      multiprocessing_context=multiprocessing.get_context(method))
    it = iter(pool)
    try:
        items = list(it)  # both workers read the array whole
        assert items == [float(dataset.array.sum()) + i for i in range(8)]
        assert it._shared_start is None  # main closed its descriptor: the workers' maps hold it
        mappings = [_start_mappings(w.pid) for w in it._workers]
    finally:
        it._shutdown_workers()
    assert all(len(m) == 1 for m in mappings), mappings
    (perms, inode), = mappings[0]
    assert perms == "rw-p"  # private (copy-on-write), readable and writable
    assert list(mappings[1]) == [(perms, inode)]  # one inode, in every worker
    kib = dataset.array.nbytes >> 10
    for fields in (m[(perms, inode)] for m in mappings):
        # every page of the array is mapped in both workers (shmem pages count as dirty:
        # main wrote them), none is a private copy (nobody wrote), and so each worker's
        # proportional share is half of what it maps
        assert fields["Shared_Clean"] + fields["Shared_Dirty"] >= kib, fields
        assert fields["Anonymous"] == 0 and fields["Private_Dirty"] == 0, fields
        assert fields["Pss"] <= fields["Rss"] // 2 + 8, fields


class Subclass(torch.Tensor):
    pass


class FromBytes:
    """Rebuilds from its bytes (custom __reduce__), as many dataset objects do."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        return FromBytes, (self.payload,)


def kinds():
    """Every kind of array or tensor a dataset may hold, large (out of band) and small."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, 301, generator=g)  # 361 KB
    rng = np.random.default_rng(3)
    structured = np.zeros(9000, dtype=[("x", "<f8"), ("label", "<i4"), ("name", "S5")])
    structured["x"] = rng.random(9000)
    readonly = rng.random(20000)
    readonly.setflags(write=False)
    return {
        "base": base, "slice": base[10:200], "transposed": base.t(), "strided": base[::3, 1::2],
        "shifted": base.view(-1)[7:7 + 4000], "as_int": base.view(torch.int32),
        "parameter": torch.nn.Parameter(torch.randn(40000, generator=g)),
        "frozen": torch.nn.Parameter(torch.randn(30000, generator=g), requires_grad=False),
        "subclass": torch.randn(50000, generator=g).as_subclass(Subclass),
        "int16": torch.randint(-999, 999, (70000,), dtype=torch.int16, generator=g),
        "bool": torch.rand(90000, generator=g) > 0.5, "half": torch.randn(60000, generator=g).half(),
        "uint16": torch.arange(50000, dtype=torch.int32).to(torch.uint16),
        "zero_dim": torch.tensor(3.5), "empty": torch.empty(0, 5), "small": torch.arange(10),
        "np_c": rng.random((300, 200)), "np_fortran": np.asfortranarray(rng.random((300, 200))),
        "np_strided": rng.random((300, 200))[::2, ::3], "np_structured": structured,
        "np_readonly": readonly, "np_objects": np.array([{"a": 1}, "b", 3] * 9000, dtype=object),
        "np_small": np.arange(5), "np_empty": np.zeros((0, 3)),
        "from_bytes": FromBytes(rng.bytes(300_000)),
        "untyped": torch.randn(30000, generator=g).untyped_storage(),
        "untyped_small": torch.arange(4, dtype=torch.int16).untyped_storage(),
    }


def expected(objects):
    """describe() of what plain pickling gives: the original for a tensor (pickling keeps
    its storage, offset and strides), pickle's own result for a numpy array (numpy
    pickles a non-contiguous one as a contiguous copy, in the stream)."""
    plain = {name: pickle.loads(pickle.dumps(obj, protocol=5)) if isinstance(obj, np.ndarray) else obj
             for name, obj in objects.items()}
    return describe(plain)


def describe(objects):
    """What must survive the trip, as one picklable string per object."""
    out = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.Tensor):
            data = obj.detach()
            shares = data.untyped_storage().data_ptr() == objects["base"].untyped_storage().data_ptr()
            out[name] = repr((type(obj).__name__, obj.dtype, tuple(obj.shape), obj.stride(),
                              obj.storage_offset(), obj.requires_grad, obj.untyped_storage().nbytes(),
                              shares, hashlib.sha1(data.contiguous().reshape(-1).view(torch.uint8).numpy()
                                                   if data.numel() else b"").hexdigest()))
        elif isinstance(obj, np.ndarray):
            values = pickle.dumps(obj.tolist()) if obj.dtype.hasobject else obj.tobytes()
            out[name] = repr((obj.dtype.descr, obj.shape, obj.strides, obj.flags.writeable,
                              obj.flags.c_contiguous, obj.flags.f_contiguous,
                              hashlib.sha1(values).hexdigest()))
        elif isinstance(obj, torch.UntypedStorage):
            data = torch.empty(0, dtype=torch.uint8).set_(obj).numpy()
            out[name] = repr((type(obj).__name__, obj.nbytes(), hashlib.sha1(data).hexdigest()))
        else:
            out[name] = repr((type(obj).__name__, hashlib.sha1(obj.payload).hexdigest()))
    return out


class Holds(Dataset):
    def __init__(self):
        self.objects = kinds()

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return describe(self.objects)


@pytest.mark.parametrize("method", METHODS)
def test_every_kind_of_array_and_tensor_arrives_as_it_left(method):
    dataset = Holds()
    want = expected(dataset.objects)
    pool = PoolLoader(dataset, batch_size=None, num_workers=1, timeout=TIMEOUT,
                      multiprocessing_context=multiprocessing.get_context(method))
    it = iter(pool)
    out_of_band = it._shared_start.out_of_band
    got = list(it)
    assert got == [want]
    # out of band: the base storage once (six views), the two Parameters, the subclass,
    # int16, bool, half, uint16, the large UntypedStorage; numpy's C, Fortran,
    # structured and read-only arrays; in the stream: what numpy copies (strided,
    # objects) and what is under the threshold
    objects = dataset.objects
    big = [objects[k] for k in ("base", "parameter", "frozen", "subclass", "int16", "bool",
                                "half", "uint16")] + [torch.empty(0).set_(objects["untyped"])]
    big_np = [objects[k] for k in ("np_c", "np_fortran", "np_structured", "np_readonly")]
    assert all(t.untyped_storage().nbytes() >= OUT_OF_BAND_BYTES for t in big)
    assert out_of_band == sum(t.untyped_storage().nbytes() for t in big) + sum(a.nbytes for a in big_np)



class _FailsToLoad:
    """Unpickles into an error (a payload a node process cannot load)."""

    def __reduce__(self):
        return _refuse, ()


def _refuse():
    raise RuntimeError("this payload does not load here")


def _start_fds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:poolloader-start")
               for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


def _load_payloads(tickets, out):
    """As a node pool's process loads them (in a child spawned for it): rank A's payload
    twice (two logical workers), then rank B's, then one that fails; what each array
    holds after a write into each, what the process maps, and what it keeps after."""
    import gc

    from poolloader.worker import startup

    found: dict = {}
    a1, a2, b = (startup.load(t, across_ranks=found) for t in tickets[:3])
    for k, loaded in enumerate((a1, a2, b)):  # each array is its own, as a DataLoader
        loaded["x"][0] = 1.0 + k              # worker's copy is
        loaded["y"][1] = 10.0 + k
    sums = [[float(loaded[k].sum()) for k in ("x", "y", "z")] for loaded in (a1, a2, b)]
    mapped = sorted(inode for _, inode in _start_mappings("self"))
    kept = len(startup._SOURCES)
    error = None
    try:
        startup.load(tickets[3], across_ranks=found)
    except RuntimeError as e:
        error = e  # kept, as a node process keeps it for the worker's first reply
    kept_after_failure = len(startup._SOURCES)
    failed = str(error)
    del a1, a2, b, loaded, error
    gc.collect()
    out.put({"sums": sums, "mapped": mapped, "kept": kept, "failed": failed,
             "kept_after_failure": kept_after_failure,
             "left": [len(startup._SOURCES), len(startup._FOUND), _start_fds(),
                      len(_start_mappings("self"))]})


def test_a_node_process_views_arrays_equal_across_ranks_once_each_its_own():
    """startup.load(across_ranks=...), in a real process over real payloads: the second
    rank's arrays equal to the first's view the first's segment (its own is unmapped),
    two equal arrays of one payload stay two arrays, a write shows in no other load's
    array, a payload that fails to load is not kept, and once the arrays are gone the
    process keeps no descriptor, mapping or record of any payload."""
    from poolloader.main.startup import SharedStart

    def payload():
        return {"x": np.zeros(1 << 17), "y": np.zeros(1 << 17),  # equal to each other
                "z": np.arange(1 << 17, dtype=np.float64)}

    starts = [SharedStart(payload()), SharedStart(payload()),
              SharedStart({"w": np.full(1 << 17, 7.0), "bad": _FailsToLoad()})]  # w: found nowhere
    tickets = [starts[0].ticket, starts[0].ticket, starts[1].ticket, starts[2].ticket]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_load_payloads, args=(tickets, out))
    child.start()
    try:
        found = out.get(timeout=TIMEOUT)
    finally:
        child.join(TIMEOUT)
        if child.is_alive():
            child.kill()
            child.join(10)
        for start in starts:
            start.close()
    assert child.exitcode == 0
    z = float(np.arange(1 << 17, dtype=np.float64).sum())
    assert found["sums"] == [[1.0, 10.0, z], [2.0, 11.0, z], [3.0, 12.0, z]], found
    # rank A's segment only (privately: once per load of it, once for B's); B's arrays
    # were all found there
    assert found["mapped"] == [starts[0].ticket[2]], found
    assert found["kept"] == 1 and found["kept_after_failure"] == 1, found
    assert found["failed"] == "this payload does not load here", found
    assert found["left"] == [0, 0, 0, 0], found
