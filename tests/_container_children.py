"""Children of tests/test_container.py: run as `python _container_children.py MODE`.

* `small-shm`: inside a private mount namespace whose /dev/shm is a 64 MiB tmpfs
  (Docker's default): PoolLoader with its default backend and 8 workers over
  RF-DETR-shaped batches (16 × 3 × 576², ~69 MiB each), every batch compared with
  the same batch made in this process; then the POSIX backend and DataLoader, each
  bounded. Prints one JSON line of what happened.
* `hold`: a PoolLoader (default backend) mid-epoch with batches held; prints
  "READY <main pid> <worker pids>" and waits (at most 60 s) to be killed.
"""
import json
import os
import sys
import time

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


if __name__ == "__main__":
    {"small-shm": small_shm, "hold": hold}[sys.argv[1]]()
