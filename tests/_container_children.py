"""Children of tests/test_container.py: run as `python _container_children.py MODE`.

* `small-shm`: inside a private mount namespace whose /dev/shm is a 64 MiB tmpfs
  (Docker's default): PoolLoader with its default backend and 8 workers over
  RF-DETR-shaped batches (16 × 3 × 576², ~69 MiB each), every batch compared with
  the same batch made in this process; then the POSIX backend and DataLoader, each
  bounded. Prints one JSON line of what happened.
* `hold`: a PoolLoader (default backend) mid-epoch with batches held; prints
  "READY <main pid> <worker pids>" and waits (at most 60 s) to be killed.
* `cgroup-cache FILE CGROUP`: run inside the memory cgroup CGROUP (its test moved this
  process there before exec): read all of FILE, so the cgroup's page cache fills to
  its limit; then one epoch of samples read from FILE with DataLoader, the same epoch
  with PoolLoader (default backend), an epoch whose slots grow after the first
  batches, and a pool larger than the cgroup can give. Prints one JSON line.
* `cgroup-epochs LOADER`: run inside a 640 MiB memory cgroup (its test moved this
  process there before exec): 3 epochs (new workers each) of batches whose size
  varies from 8 to 48 MiB, with DataLoader or PoolLoader (LOADER: "dataloader" or
  "pool"), 2 fork workers; prints one JSON line: each batch's digest, and the pool's
  stats.
* `no-proc-fd METHOD`: run without CAP_SYS_PTRACE (its test starts it under setpriv
  or capsh); makes itself non-dumpable (prctl PR_SET_DUMPABLE 0), so no other process
  of its user may open /proc/<its pid>/fd/N, then runs PoolLoader epochs with workers
  started by METHOD: the default backend twice, shm_backend="posix", and
  shm_backend="memfd". Prints one JSON line.
"""
import ctypes
import hashlib
import json
import multiprocessing
import os
import sys
import time
import warnings

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fixtures.synthetic import FilledDetectionDataset  # noqa: E402
from poolloader import PoolLoader  # noqa: E402
from poolloader.detection import DetectionCollate  # noqa: E402
from poolloader.errors import ShmSpaceError  # noqa: E402

BATCH = 16


def same(a, b) -> bool:
    images_a, mask_a, targets_a = a
    images_b, mask_b, targets_b = b
    return (torch.equal(images_a, images_b) and torch.equal(mask_a, mask_b)
            and len(targets_a) == len(targets_b)
            and all(ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
                    for ta, tb in zip(targets_a, targets_b)))


def small_shm() -> None:
    st = os.statvfs("/dev/shm")
    out = {"shm_bytes": st.f_blocks * st.f_frsize}
    data = FilledDetectionDataset(BATCH * 16, resolution=576)
    collate = DetectionCollate(pack=False)

    # 1. the default backend: every batch, checked against one made here
    loader = PoolLoader(data, batch_size=BATCH, num_workers=8, collate_fn=collate, timeout=120)
    checked, names_seen = 0, set()
    for k, batch in enumerate(loader):
        names_seen |= set(os.listdir("/dev/shm"))
        expected = collate([data[i] for i in range(k * BATCH, (k + 1) * BATCH)])
        if not same(batch, expected):
            out["mismatch"] = k
            break
        checked += 1
        del batch
    out["pool_batches"] = checked
    out["pool_batch_bytes"] = int(expected[0].nbytes + expected[1].nbytes)
    out["pool_names_seen"] = sorted(names_seen)
    out["pool_backend_bytes"] = loader.stats.peak_pool_bytes

    # 2. the POSIX backend: a clear error at once, naming the knob
    t0 = time.monotonic()
    try:
        next(iter(PoolLoader(data, batch_size=BATCH, num_workers=2, collate_fn=collate,
                             shm_backend="posix", slot_bytes=80 << 20)))
        out["posix"] = "ran"
    except ShmSpaceError as e:
        out["posix"] = f"ShmSpaceError: {e}"
    out["posix_s"] = time.monotonic() - t0

    # 3. DataLoader, bounded by its own timeout=
    t0 = time.monotonic()
    try:
        for _ in DataLoader(data, batch_size=BATCH, num_workers=2, collate_fn=collate, timeout=10):
            pass
        out["dataloader"] = "ran"
    except Exception as e:  # noqa: BLE001 - whatever it raises is the observation
        out["dataloader"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["dataloader_s"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


def hold() -> None:
    data = torch.arange(8 * (8 << 18), dtype=torch.float32).view(8 * 8, 1 << 18)  # 1 MiB rows
    loader = PoolLoader(data, batch_size=8, num_workers=3, slot_bytes=12 << 20)
    it = iter(loader)
    held = [next(it), next(it)]  # each worker has mapped every slot at its start
    print("READY", os.getpid(), *it.worker_pids, flush=True)
    time.sleep(60)
    del held


class FileSamples(torch.utils.data.Dataset):
    """Sample i: `sizes[i]` bytes of the file at an offset spread over all of it (each
    epoch reads across the file, as a job reading its data does)."""

    def __init__(self, path: str, sizes: list[int]):
        self.path, self.sizes = path, sizes
        self.span = os.path.getsize(path) - max(sizes)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        with open(self.path, "rb", buffering=0) as f:
            f.seek(i * 104_729 * 4096 % self.span)
            return torch.frombuffer(bytearray(f.read(self.sizes[i])), dtype=torch.uint8)


def _cache_stat(cgroup: str) -> dict:
    with open(os.path.join(cgroup, "memory.stat")) as f:
        stat = dict((k, int(v)) for k, v in (line.split() for line in f))
    return {"cache": stat["total_inactive_file"] + stat["total_active_file"],
            "shmem": stat["total_shmem"], "rss": stat["total_rss"]}


def _digests(loader) -> list[str]:
    return [hashlib.sha1(memoryview(batch.numpy())).hexdigest() for batch in loader]


def cgroup_cache(path: str, cgroup: str) -> None:
    from poolloader.shm.backends.memfd import memory_available
    with open("/proc/self/cgroup") as f:
        out: dict = {"cgroup": [line.split(":", 2)[2] for line in f.read().splitlines()
                                if line.split(":")[1] == "memory"]}
    with open(path, "rb", buffering=0) as f:  # the job reads its data
        while f.read(8 << 20):
            pass
    out["after_read"] = _cache_stat(cgroup)
    out["available_after_read"] = memory_available()
    mib = 1 << 20

    # 1. one epoch, DataLoader then PoolLoader: 2 MiB samples, 8 MiB batches
    data = FileSamples(path, [2 * mib] * 48)
    out["dataloader"] = _digests(DataLoader(data, batch_size=4, num_workers=2, timeout=120))
    try:
        out["pool"] = _digests(PoolLoader(data, batch_size=4, num_workers=2, timeout=120))
    except ShmSpaceError as e:
        out["pool"] = f"ShmSpaceError: {e}"

    # 2. slots grow after the cache filled: 256 KiB samples first, then 2 MiB ones
    data = FileSamples(path, [mib // 4] * 16 + [2 * mib] * 32)
    out["growth_dataloader"] = _digests(DataLoader(data, batch_size=4, num_workers=2, timeout=120))
    loader = PoolLoader(data, batch_size=4, num_workers=2, timeout=120, slot_bytes=mib)
    try:
        out["growth"] = _digests(loader)
    except ShmSpaceError as e:
        out["growth"] = f"ShmSpaceError: {e}"
    out["slot_growths"] = loader.stats.slot_growths
    out["during_growth_run"] = _cache_stat(cgroup)

    # 3. nearly all of what it counts as available is there: a pool of that size is
    # made (its pages reserved: reclaim frees the cache) and delivers batches
    free = memory_available()[0]
    out["near_free"] = free
    try:
        loader = PoolLoader(data, batch_size=4, num_workers=1, prefetch_factor=1, slots=2,
                            max_slots=2, slot_bytes=max(mib, (free - 96 * mib) // 2))
        it = iter(loader)
        out["near"] = [int(next(it).numel()) for _ in range(4)]
        out["near_pool_bytes"] = loader.stats.pool_bytes
        out["after_near"] = _cache_stat(cgroup)
        del it
    except ShmSpaceError as e:
        out["near"] = f"ShmSpaceError: {e}"

    # 4. what the cgroup cannot give even with its cache reclaimed: refused, not OOM
    free = memory_available()[0]
    out["refused_free"] = free
    try:
        next(iter(PoolLoader(data, batch_size=4, num_workers=2, slots=2,
                             slot_bytes=free // 2 + 16 * mib)))  # 32 MiB too many
        out["refused"] = "ran"
    except ShmSpaceError as e:
        out["refused"] = f"ShmSpaceError: {e}"
    print(json.dumps(out), flush=True)


PR_SET_DUMPABLE = 4


def _a_child_opens(path: str) -> bool:
    """Whether a forked child of this process can open `path` as a worker would."""
    pid = os.fork()
    if pid == 0:
        try:
            os.close(os.open(path, os.O_RDWR))
            os._exit(0)
        except OSError:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _epoch(data, method: str, backend) -> dict:
    """One epoch of `data` with 2 workers of `method`: whether every batch was right,
    which backend the pool used, or the error."""
    loader = PoolLoader(data, batch_size=8, num_workers=2, timeout=60, shm_backend=backend,
                        multiprocessing_context=multiprocessing.get_context(method))
    try:
        it = iter(loader)
        used = "posix" if it.shm_prefix is not None else "memfd"
        right = all(torch.equal(batch, data[8 * k:8 * (k + 1)]) for k, batch in enumerate(it))
        return {"right": right, "batches": loader.stats.batches, "backend": used}
    except Exception as e:  # noqa: BLE001 - whatever it raises is the observation
        return {"error": f"{type(e).__name__}: {e}"}


def no_proc_fd(method: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    probe = os.memfd_create("no-proc-fd-probe", os.MFD_CLOEXEC)
    out: dict = {"child_opens": _a_child_opens(f"/proc/{os.getpid()}/fd/{probe}")}
    os.close(probe)
    with open("/proc/self/status") as f:
        out["cap_eff"] = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    data = torch.arange(64 * 256, dtype=torch.float32).view(64, 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["default"] = [_epoch(data, method, None), _epoch(data, method, None)]
        out["posix"] = _epoch(data, method, "posix")
        out["memfd"] = _epoch(data, method, "memfd")
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                       if "poolloader" in str(w.message).lower()]
    print(json.dumps(out), flush=True)


class VaryingBatches(torch.utils.data.Dataset):
    """Item i: a float32 tensor of 1 to 6 MiB (the same for every item of a batch of
    8: batches of 8 to 48 MiB, varying from batch to batch) filled with i plus a
    random number (workers' seeding shows)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int):
        mib = 1 + (i // 8 * 5) % 6
        return torch.full((mib, 256, 1024), float(i)) + torch.rand(1)


def cgroup_epochs(kind: str) -> None:
    cls = DataLoader if kind == "dataloader" else PoolLoader
    loader = cls(VaryingBatches(), batch_size=8, num_workers=2,
                 generator=torch.Generator().manual_seed(0),
                 multiprocessing_context=multiprocessing.get_context("fork"), timeout=120)
    out: dict = {"digests": []}
    for _ in range(3):
        out["digests"] += _digests(loader)
    if kind != "dataloader":
        out["stats"] = {k: v for k, v in loader.stats.as_dict().items()
                        if k in ("slot_growths", "pool_growths", "peak_slot_count",
                                 "peak_pool_bytes", "pages_returned")}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    {"small-shm": small_shm, "hold": hold, "cgroup-cache": cgroup_cache,
     "no-proc-fd": no_proc_fd, "cgroup-epochs": cgroup_epochs}[sys.argv[1]](*sys.argv[2:])
