"""GPU checks and benchmark for poolloader, in one run of at most --budget seconds (default 450).

Method, in one process on the machine's CUDA devices:

1. Corruption checks (issue 14). Each check keeps slots in reuse while copies out
   of them are still queued, then compares every copied batch with the values its
   samples must hold (sample i is a tensor full of i):
   a. side stream, next() outside it: next() runs on the default stream, the copy
      is queued on a side stream behind torch.cuda._sleep (~30 ms), the batch is
      dropped at once; 2 slots (then max_slots=2, which forces cooling waits);
   b. in-stream: the old check, next() inside a slow consumer stream's context;
   c. two devices (when there are two): copies to cuda:1 on its busy current stream
      while next() runs on device 0, and torch.nn.parallel.scatter (DataParallel's
      per-device copy streams, delayed by a kernel queued on them);
   d. device= with a stream switch between calls: every next() under a different
      current stream, the stager's side stream delayed by a kernel before each call
      (white-box: `it._stager.stream`), so its copies lag the slots' reuse.
   Any mismatch: exit code 1.
2. H2D bandwidth: a --mib MiB source copied to the device 10 times (after a warm-up)
   from (a) a poolloader slot registered with cudaHostRegister, (b) a torch-pinned
   tensor (pin_memory()), (c) a pageable tensor. GB/s, median [min–max].
3. Gate cost: microseconds per release (marker over every busy torch stream of every
   device with a context) with the default stream busy, over 200 releases.
4. Loader throughput on the RF-DETR shape (batch 16 of 3×576×576 float32 images,
   576×576 bool masks, 16 target dicts of 7 tensors) at --workers (8,16,32) for
   DataLoader(pin_memory=True), PoolLoader(pin_memory=True) and PoolLoader(device="cuda").
   Every arm copies every batch to the GPU (non_blocking) and synchronises at the
   end; img/s over --batches batches after 5 warm-up ones, median [min–max] over
   --reps interleaved repetitions, and the ratio to DataLoader. A worker count whose
   prefetched batches would not fit in /dev/shm is skipped, with a note.

Prints Markdown tables and writes every number as JSON (--json). Without CUDA it
says so and exits 2; past --budget it prints what it has and exits 3; on an error
(not a corruption) it exits 4.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from poolloader import PoolLoader, cuda  # noqa: E402
from poolloader.pool import SlotPool  # noqa: E402
from poolloader.segments import shm_free_bytes  # noqa: E402
from poolloader.slot_format import DATA_OFF  # noqa: E402

SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: ~30 ms on current GPUs
CHECK_SLOT_BYTES = 10 << 20  # a Full batch is 8 MiB: no growth path in the checks


class Full(Dataset):
    """Sample i is a tensor full of i: a copy shows which samples it read."""

    def __init__(self, n: int, shape=(4, 1 << 18)):
        self.n = n
        self.shape = shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full(self.shape, float(i))


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


RFDETR_BATCH_BYTES = 16 * (3 * 576 * 576 * 4 + 576 * 576) + (1 << 20)


def stat(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def fmt(s, digits=1):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def wrong_batches(outs, batch_size=2):
    """Indices k of copied batches whose samples are not k*batch_size + j throughout."""
    bad = []
    for k, out in enumerate(outs):
        want = torch.arange(batch_size * k, batch_size * (k + 1), dtype=out.dtype, device=out.device)
        want = want.view(-1, *([1] * (out.dim() - 1))).expand_as(out)
        if not torch.equal(out, want):
            bad.append(k)
    return bad


def finish(it) -> None:
    """Shut an iterator down on the normal path (not from a finaliser: its pool's
    memory goes back now, before the next arm's pool is made)."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


# ---------------------------------------------------------------------------
# 1. corruption checks

def check_side_stream(batches: int, max_slots) -> dict:
    loader = PoolLoader(Full(2 * batches), batch_size=2, num_workers=2, pin_memory=True,
                        slots=2, max_slots=max_slots, prefetch_factor=1, slot_bytes=CHECK_SLOT_BYTES)
    it = iter(loader)
    side, outs = torch.cuda.Stream(), []
    for _ in range(batches):
        b = next(it)  # current stream = default stream
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)  # the copy waits behind ~30 ms of work
            outs.append(b.to("cuda", non_blocking=True))
        del b
    torch.cuda.synchronize()
    bad = wrong_batches(outs)
    finish(it)
    return {"batches": len(outs), "bad": bad, "stats": loader.stats.as_dict()}


def check_in_stream(batches: int) -> dict:
    loader = PoolLoader(Full(2 * batches), batch_size=2, num_workers=2, pin_memory=True,
                        slots=2, max_slots=2, prefetch_factor=1, slot_bytes=CHECK_SLOT_BYTES)
    stream, outs = torch.cuda.Stream(), []
    with torch.cuda.stream(stream):
        for b in loader:
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            outs.append(b.to("cuda", non_blocking=True))
            del b
    torch.cuda.synchronize()
    return {"batches": len(outs), "bad": wrong_batches(outs), "stats": loader.stats.as_dict()}


def _delay_scatter_streams(devices) -> None:
    """Queue a kernel on DataParallel's background copy streams (private torch API:
    skipped if it changed)."""
    try:
        from torch.nn.parallel._functions import _get_stream
        for d in devices:
            try:
                stream = _get_stream(torch.device("cuda", d))
            except (TypeError, AttributeError):
                stream = _get_stream(d)
            if stream is not None:
                with torch.cuda.device(d), torch.cuda.stream(stream):
                    torch.cuda._sleep(SLEEP_CYCLES)
    except (ImportError, RuntimeError):
        pass


def check_two_devices(batches: int) -> dict:
    from torch.nn.parallel import scatter
    loader = PoolLoader(Full(2 * batches), batch_size=2, num_workers=2, pin_memory=True,
                        slots=2, max_slots=2, prefetch_factor=1, slot_bytes=CHECK_SLOT_BYTES)
    it = iter(loader)
    outs = []
    for k in range(batches):
        b = next(it)  # device 0 current
        if k % 2:
            with torch.cuda.device(1):
                torch.cuda._sleep(SLEEP_CYCLES)  # device 1's current stream is busy
                outs.append(b.to("cuda:1", non_blocking=True))
        else:
            _delay_scatter_streams((0, 1))
            halves = scatter(b, [0, 1])  # DataParallel's input scatter
            outs.append(torch.cat([h.to("cuda:0") for h in halves]))
        del b
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    bad = wrong_batches([o.to("cuda:0") for o in outs])
    finish(it)
    return {"batches": len(outs), "bad": bad, "stats": loader.stats.as_dict()}


def check_device_stream_switch(batches: int) -> dict:
    loader = PoolLoader(Full(2 * batches), batch_size=2, num_workers=2, device="cuda",
                        slots=2, max_slots=2, prefetch_factor=1, slot_bytes=CHECK_SLOT_BYTES)
    it = iter(loader)
    streams = [torch.cuda.Stream() for _ in range(4)]
    outs = []
    for k in range(batches):
        with torch.cuda.stream(it._stager.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the staged copy lags behind
        with torch.cuda.stream(streams[k % len(streams)]):
            d = next(it)
            outs.append(d * 1)  # used on this stream, as a consumer would
        del d
    torch.cuda.synchronize()
    bad = wrong_batches(outs)
    finish(it)
    return {"batches": len(outs), "bad": bad, "stats": loader.stats.as_dict()}


# ---------------------------------------------------------------------------
# 2, 3. bandwidth and gate cost

def bandwidth(nbytes: int, reps: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gate = cuda.SlotGate(cuda.torch_runtime())
    pool = SlotPool(1, 1, 1, nbytes + DATA_OFF, on_map=gate.register, on_unmap=gate.unregister)
    out = {}
    try:
        import numpy as np
        slot = torch.from_numpy(np.frombuffer(pool.mappings[0], np.uint8, count=nbytes,
                                              offset=DATA_OFF))
        slot.fill_(1)
        sources = {
            "registered slot": slot,
            "torch-pinned tensor": torch.ones(nbytes, dtype=torch.uint8).pin_memory(),
            "pageable tensor": torch.ones(nbytes, dtype=torch.uint8),
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
    finally:
        gate.close()
        pool.close()
    return out


def gate_cost(releases: int = 200) -> dict:
    rt = cuda.torch_runtime()
    gate = cuda.SlotGate(rt)
    rt.streams(torch.cuda.current_device())  # lists torch's stream pool once, untimed
    torch.cuda._sleep(SLEEP_CYCLES)  # the default stream is busy: one event per release
    t0 = time.perf_counter()
    for k in range(releases):
        gate.release(k)
    release_us = (time.perf_counter() - t0) / releases * 1e6
    t0 = time.perf_counter()
    gate.ready()
    ready_us = (time.perf_counter() - t0) * 1e6
    streams = len(rt.streams(torch.cuda.current_device()))
    gate.close()
    return {"release_us": release_us, "ready_us_for_all": ready_us, "known_streams": streams,
            "devices_with_context": rt.devices_with_context()}


# ---------------------------------------------------------------------------
# 4. throughput

ARMS = ["DataLoader(pin_memory=True)", "PoolLoader(pin_memory=True)", 'PoolLoader(device="cuda")']


def run_loader(kind: str, workers: int, batches: int, data) -> float:
    kw = dict(batch_size=16, collate_fn=collate, num_workers=workers, prefetch_factor=2)
    if kind == ARMS[0]:
        loader = DataLoader(data, pin_memory=True, **kw)
    elif kind == ARMS[1]:
        loader = PoolLoader(data, pin_memory=True, slot_bytes=RFDETR_BATCH_BYTES, **kw)
    else:
        loader = PoolLoader(data, device="cuda", slot_bytes=RFDETR_BATCH_BYTES, **kw)
    it = iter(loader)
    n, t0 = 0, None
    try:
        for batch in it:
            if not batch[0].is_cuda:
                batch = (batch[0].to("cuda", non_blocking=True), batch[1].to("cuda", non_blocking=True),
                         [{k: v.to("cuda", non_blocking=True) for k, v in d.items()} for d in batch[2]])
            del batch
            n += 1
            if n == 5:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            if n == batches + 5:
                break
        torch.cuda.synchronize()
        return batches * 16 / (time.perf_counter() - t0)
    finally:
        finish(it)


def throughput(workers: list[int], batches: int, reps: int, notes: list[str]) -> dict:
    data = RFDETRShaped(16 * (batches + 10))
    out = {}
    for w in workers:
        needed = (w * 2 + 2) * RFDETR_BATCH_BYTES * 1.3
        if needed > shm_free_bytes():
            notes.append(f"{w} workers skipped: their prefetched batches need ~{needed / 2**30:.1f} GiB "
                         f"of /dev/shm, {shm_free_bytes() / 2**30:.1f} GiB are free")
            continue
        runs = {a: [] for a in ARMS}
        for rep in range(reps):
            for a in ARMS[rep % 3:] + ARMS[:rep % 3]:
                runs[a].append(run_loader(a, w, batches, data))
        out[w] = {a: stat(v) for a, v in runs.items()}
    return out


# ---------------------------------------------------------------------------

class OutOfBudget(Exception):
    pass


def _alarm(_signum, _frame):
    raise OutOfBudget()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--workers", default="8,16,32", help="worker counts for the throughput part")
    ap.add_argument("--batches", type=int, default=40, help="timed batches per throughput run")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per throughput arm")
    ap.add_argument("--checks", type=int, default=32, help="batches per corruption check")
    ap.add_argument("--mib", type=int, default=256, help="MiB per bandwidth copy")
    ap.add_argument("--budget", type=int, default=450, help="seconds for the whole run")
    ap.add_argument("--json", default="gpu-bench.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine: nothing to check or measure "
              "(run it on a GPU machine)")
        return 2
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(args.budget)
    started = time.monotonic()
    name = torch.cuda.get_device_name()
    results: dict = {"device": name, "devices": torch.cuda.device_count(), "torch": torch.__version__,
                     "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                     "shm_free_gib": round(shm_free_bytes() / 2**30, 1), "checks": {}, "notes": []}
    print(f"# poolloader on {results['devices']}× {name}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {results['date']}\n")
    corrupted = False
    try:
        checks = results["checks"]
        checks["side stream, next() outside it"] = check_side_stream(args.checks, None)
        checks["side stream, next() outside it, max_slots=2"] = check_side_stream(args.checks, 2)
        checks["in-stream (slow consumer stream)"] = check_in_stream(args.checks)
        if torch.cuda.device_count() >= 2:
            checks["two devices: cuda:1 current stream + DataParallel scatter"] = \
                check_two_devices(args.checks)
        else:
            results["notes"].append("two-device check skipped: one CUDA device")
        checks["device= with a stream switch per call"] = check_device_stream_switch(args.checks)
        print("| corruption check | batches | corrupted | cooling waits / growths |\n|---|---:|---|---:|")
        for label, c in checks.items():
            corrupted |= bool(c["bad"]) or c["batches"] != args.checks
            print(f"| {label} | {c['batches']} | {c['bad'] or 'none'} | "
                  f"{c['stats']['cooling_waits']} / {c['stats']['cooling_growths']} |")

        nbytes = args.mib << 20
        if nbytes + DATA_OFF > shm_free_bytes() // 2:
            nbytes = max(1 << 20, (shm_free_bytes() // 4) >> 20 << 20)
            results["notes"].append(f"bandwidth copies shrunk to {nbytes >> 20} MiB (/dev/shm)")
        bw = results["bandwidth_GBps"] = bandwidth(nbytes, 10)
        print(f"\n| H2D copy of {nbytes >> 20} MiB from | GB/s median [min–max] | is_pinned |\n"
              "|---|---:|---|")
        for k, v in bw.items():
            print(f"| {k} | {fmt(v, 2)} | {v['is_pinned']} |")

        gc_ = results["gate_cost"] = gate_cost()
        print(f"\ngate: {gc_['release_us']:.1f} µs per release ({gc_['known_streams']} torch streams "
              f"known on the device, devices with a context {gc_['devices_with_context']}); "
              f"ready() over {200} keys {gc_['ready_us_for_all']:.0f} µs")

        tp = results["throughput_img_s"] = throughput(
            [int(w) for w in args.workers.split(",")], args.batches, args.reps, results["notes"])
        print("\n| workers | " + " | ".join(ARMS) + " |\n|---:|" + "---:|" * len(ARMS))
        for w, row in tp.items():
            base = row[ARMS[0]]["median"]
            cells = [f"{fmt(row[a])} ({row[a]['median'] / base:.2f}×)" for a in ARMS]
            print(f"| {w} | " + " | ".join(cells) + " |")
        status = 1 if corrupted else 0
    except OutOfBudget:
        results["notes"].append(f"stopped after the --budget of {args.budget} s")
        status = 1 if corrupted else 3
    except Exception:  # a crash is not a corruption: its own exit code
        traceback.print_exc()
        results["notes"].append("stopped by the error above")
        status = 1 if corrupted else 4
    finally:
        signal.alarm(0)
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    for note in results["notes"]:
        print(f"\nnote: {note}")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\n{results['elapsed_s']} s; RESULT:", {0: "PASS", 1: "FAIL: corrupted batches",
                                                   3: "INCOMPLETE (budget)", 4: "ERROR"}[status])
    return status


if __name__ == "__main__":
    sys.exit(main())
