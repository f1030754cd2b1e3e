"""GPU check and benchmark for poolloader, in one self-contained run (< 5 minutes on one GPU).

Method, in one process run on one CUDA device:

1. H2D bandwidth. A 256 MiB source is copied to the device 10 times (after one
   warm-up) from (a) a poolloader slot registered with cudaHostRegister, (b) a
   pageable torch tensor, (c) a torch-pinned tensor (pin_memory()). Reported:
   GB/s, median [min–max].
2. Loader throughput on the RF-DETR shape (batch 16 of 3×576×576 float32 images,
   576×576 bool masks, 16 target dicts of 7 tensors), for DataLoader(pin_memory=True),
   PoolLoader(pin_memory=True) and PoolLoader(device="cuda") at 4/8/12 workers. Each
   arm copies every batch to the GPU (non_blocking) and synchronises at the end;
   img/s over --batches batches after 5 warm-up batches, median [min–max] over
   --reps interleaved repetitions, ratio to DataLoader.
3. Stress: a slow consumer stream (torch.cuda._sleep) and a tiny pool (2 slots,
   prefetch 1) force slot reuse while copies are still queued; every batch's
   device contents are checked bit for bit against a CPU reference built by
   DataLoader(num_workers=0). Any mismatch fails the run (exit code 1).

Prints a Markdown table per part and writes all numbers as JSON (--json).
Without CUDA it says so and exits 2 (nothing to measure).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from poolloader import PoolLoader  # noqa: E402
from poolloader.pool import SlotPool  # noqa: E402


class RFDETRShaped(Dataset):
    """Cheap deterministic samples of the RF-DETR shape (workers are not the bottleneck)."""

    def __init__(self, n: int, hw: int = 576):
        self.n = n
        self.hw = hw
        g = torch.Generator().manual_seed(0)
        self.base = torch.rand(3, hw, hw, generator=g)
        self.mask = torch.rand(hw, hw, generator=g) > 0.9

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = (i * 5) % 13
        g = torch.Generator().manual_seed(i)
        return (self.base + i, self.mask, {
            "boxes": torch.rand(k, 4, generator=g), "labels": torch.randint(0, 90, (k,), generator=g),
            "image_id": torch.tensor([i]), "area": torch.rand(k, generator=g),
            "iscrowd": torch.zeros(k, dtype=torch.int64), "orig_size": torch.tensor([480, 640]),
            "size": torch.tensor([self.hw, self.hw])})


def collate(batch):
    return (torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]),
            tuple(b[2] for b in batch))


def stat(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def fmt(s, digits=1):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def bandwidth(nbytes: int, reps: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    pool = SlotPool(1, 1, 1, nbytes + 65536)
    try:
        from poolloader.cuda import SlotGate
        gate = SlotGate()
        mapping = pool.mappings[0]
        gate.register(mapping)
        import numpy as np
        slot = torch.from_numpy(np.frombuffer(mapping, np.uint8, count=nbytes))
        slot.fill_(1)
        sources = {
            "registered slot": slot,
            "pageable tensor": torch.ones(nbytes, dtype=torch.uint8),
            "torch-pinned tensor": torch.ones(nbytes, dtype=torch.uint8).pin_memory(),
        }
        for name, src in sources.items():
            rates = []
            for k in range(reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dev.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                if k:
                    rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
            out[name] = stat(rates)
            out[name]["is_pinned"] = bool(src.is_pinned())
        del slot, sources
        gate.unregister(mapping)
    finally:
        pool.close()
    return out


def run_loader(kind: str, workers: int, batches: int, data) -> float:
    kw = dict(batch_size=16, collate_fn=collate, num_workers=workers, prefetch_factor=2)
    if kind == "DataLoader(pin_memory=True)":
        loader = DataLoader(data, pin_memory=True, **kw)
    elif kind == "PoolLoader(pin_memory=True)":
        loader = PoolLoader(data, pin_memory=True, slot_bytes=80 << 20, **kw)
    else:
        loader = PoolLoader(data, device="cuda", slot_bytes=80 << 20, **kw)
    it = iter(loader)
    n = 0
    t0 = None
    for batch in it:
        images = batch[0] if batch[0].is_cuda else batch[0].to("cuda", non_blocking=True)
        if not batch[0].is_cuda:
            [t.to("cuda", non_blocking=True) for d in batch[2] for t in d.values()]
        del images, batch
        n += 1
        if n == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        if n == batches + 5:
            break
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del it, loader
    return batches * 16 / elapsed


def stress(batches: int) -> dict:
    data = RFDETRShaped(batches * 4, hw=256)
    ref = list(DataLoader(data, batch_size=4, collate_fn=collate))
    loader = PoolLoader(data, batch_size=4, collate_fn=collate, num_workers=2, pin_memory=True,
                        slots=2, max_slots=2, prefetch_factor=1)
    stream = torch.cuda.Stream()
    outs = []
    with torch.cuda.stream(stream):
        for batch in loader:
            torch.cuda._sleep(5_000_000)
            outs.append((batch[0].to("cuda", non_blocking=True), batch[1].to("cuda", non_blocking=True),
                         [t.to("cuda", non_blocking=True) for d in batch[2] for t in d.values()]))
            del batch
    torch.cuda.synchronize()
    bad = 0
    for (img, mask, targets), want in zip(outs, ref):
        wt = [t for d in want[2] for t in d.values()]
        ok = torch.equal(img.cpu(), want[0]) and torch.equal(mask.cpu(), want[1]) and \
            all(torch.equal(a.cpu(), b) for a, b in zip(targets, wt))
        bad += not ok
    return {"batches": len(outs), "expected": len(ref), "mismatched": bad}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,8,12")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="gpu-bench.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (bench/gpu.py needs a GPU)")
        return 2
    name = torch.cuda.get_device_name()
    print(f"# poolloader on {name}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    results = {"device": name, "torch": torch.__version__}

    bw = results["bandwidth_GBps"] = bandwidth(256 << 20, 10)
    print("| H2D copy of 256 MiB from | GB/s median [min–max] | is_pinned |\n|---|---:|---|")
    for k, v in bw.items():
        print(f"| {k} | {fmt(v, 2)} | {v['is_pinned']} |")

    arms = ["DataLoader(pin_memory=True)", "PoolLoader(pin_memory=True)", 'PoolLoader(device="cuda")']
    workers = [int(w) for w in args.workers.split(",")]
    data = RFDETRShaped(16 * (args.batches + 10))
    tp = {}
    for w in workers:
        runs = {a: [] for a in arms}
        for rep in range(args.reps):
            for a in arms[rep % 3:] + arms[:rep % 3]:
                runs[a].append(run_loader(a, w, args.batches, data))
        tp[w] = {a: stat(v) for a, v in runs.items()}
    results["throughput_img_s"] = tp
    print("\n| workers | " + " | ".join(arms) + " |\n|---:|" + "---:|" * len(arms))
    for w, row in tp.items():
        base = row[arms[0]]["median"]
        cells = [f"{fmt(row[a])} ({row[a]['median'] / base:.2f}×)" for a in arms]
        print(f"| {w} | " + " | ".join(cells) + " |")

    st = results["stress"] = stress(60)
    print(f"\nstress: {st['batches']}/{st['expected']} batches, {st['mismatched']} mismatched")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    ok = st["mismatched"] == 0 and st["batches"] == st["expected"]
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
