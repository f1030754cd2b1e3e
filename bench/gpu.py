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
3. Gate cost: microseconds per release (marker over the streams that may hold work:
   default, pool streams handed out, current) with the default stream busy, over
   200 releases.
4. Loader throughput on the RF-DETR shape (bench/workload.py's `RFDETRShaped` and
   `RFDETRCollate("per_sample")`: batch 16 of 3×576×576 float32 images, 576×576 bool
   masks, 16 target dicts of 7 tensors) at --workers (8,16,32) for
   DataLoader(pin_memory=True), PoolLoader(pin_memory=True) and PoolLoader(device="cuda").
   Every arm copies every batch to the GPU (non_blocking) and synchronises at the
   end; img/s over --batches batches after 5 warm-up ones, median [min–max] over
   --reps repetitions interleaved by bench/common.py's runner, and the paired ratio
   to DataLoader. Also the main thread's CPU time per batch over the same window
   (time.thread_time: next(), del, issuing the copies) and DataLoader's pin-memory
   thread's (/proc schedstat): the work PoolLoader's gate does on the main thread
   against the work DataLoader does on its pin thread. A worker count whose
   prefetched batches would not fit in /dev/shm is skipped, with a note.

Prints Markdown tables and writes every number as JSON (--json, default
gpu-bench.json; or --out DIR). Without CUDA it says so and exits 2; past --budget
it prints what it has and exits 3; on an error (not a corruption) it exits 4.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from poolloader import PoolLoader  # noqa: E402
from poolloader.cuda import gate as cuda
from poolloader.shm.backends.posix import shm_free_bytes  # noqa: E402
from poolloader.shm.pool import SlotPool  # noqa: E402
from poolloader.wire.slot_format import DATA_OFF  # noqa: E402

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


RFDETR_BATCH_BYTES = 16 * (3 * 576 * 576 * 4 + 576 * 576) + (1 << 20)


def wrong_batches(outs, batch_size=2):
    """Indices k of copied batches whose samples are not k*batch_size + j throughout."""
    bad = []
    for k, out in enumerate(outs):
        want = torch.arange(batch_size * k, batch_size * (k + 1), dtype=out.dtype, device=out.device)
        want = want.view(-1, *([1] * (out.dim() - 1))).expand_as(out)
        if not torch.equal(out, want):
            bad.append(k)
    return bad


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
    workload.shutdown_iterator(it)
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
    workload.shutdown_iterator(it)
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
    workload.shutdown_iterator(it)
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
            out[name] = {**common.summarize(rates).as_dict(), "is_pinned": bool(src.is_pinned())}
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


def run_loader(kind: str, workers: int, batches: int, data) -> dict:
    pool = kind != ARMS[0]
    kw = dict(batch_size=workload.BATCH, collate_fn=workload.RFDETRCollate("per_sample", pool=pool),
              num_workers=workers, prefetch_factor=2)
    if kind == ARMS[0]:
        loader = DataLoader(data, pin_memory=True, **kw)
    elif kind == ARMS[1]:
        loader = PoolLoader(data, pin_memory=True, slot_bytes=RFDETR_BATCH_BYTES, **kw)
    else:
        loader = PoolLoader(data, device="cuda", slot_bytes=RFDETR_BATCH_BYTES, **kw)
    it = iter(loader)
    n, t0, main0, pin0 = 0, 0.0, 0, 0
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
                main0, pin0 = time.thread_time_ns(), _pin_thread_ns(it)
            if n == batches + 5:
                break
        main_ns, pin_ns = time.thread_time_ns() - main0, _pin_thread_ns(it) - pin0
        torch.cuda.synchronize()
        if n < batches + 5:
            raise common.BenchError(f"{kind}: {n} batches, {batches + 5} expected")
        return {"img_s": batches * workload.BATCH / (time.perf_counter() - t0),
                "main_ms": main_ns / batches / 1e6, "pin_thread_ms": pin_ns / batches / 1e6}
    finally:
        workload.shutdown_iterator(it)


def _pin_thread_ns(it) -> int:
    """CPU time of DataLoader's pin-memory thread so far (0 for PoolLoader, which has none)."""
    thread = getattr(it, "_pin_memory_thread", None)
    tid = getattr(thread, "native_id", None)
    if tid is None:
        return 0
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def throughput(workers: list[int], batches: int, reps: int, notes: list[str]) -> common.Raw:
    data = workload.RFDETRShaped(workload.BATCH * (batches + 10))
    cells = []
    for w in workers:
        needed = (w * 2 + 2) * RFDETR_BATCH_BYTES * 1.3
        if needed > shm_free_bytes():
            notes.append(f"{w} workers skipped: their prefetched batches need ~{needed / 2**30:.1f} GiB "
                         f"of /dev/shm, {shm_free_bytes() / 2**30:.1f} GiB are free")
        else:
            cells.append(w)
    return common.interleave(cells, ARMS, lambda w, arm, _rep: run_loader(arm, w, batches, data),
                             reps, label="gpu throughput")


# ---------------------------------------------------------------------------

class OutOfBudget(BaseException):
    """Past --budget (SIGALRM). A BaseException, so the runner's per-arm `except
    Exception` (a failed arm is a result) does not swallow it."""


def _alarm(_signum, _frame):
    raise OutOfBudget()


def main(argv=None) -> int:
    ap = common.parser("gpu", __doc__, reps=(3, 2), warmup_reps=(0, 0))
    ap.add_argument("--workers", default=None, help="worker counts for the throughput part "
                    "(default 8,16,32; quick 8)")
    ap.add_argument("--batches", type=int, default=None, help="timed batches per throughput run "
                    "(default 40; quick 10)")
    ap.add_argument("--checks", type=int, default=None, help="batches per corruption check "
                    "(default 32; quick 8)")
    ap.add_argument("--mib", type=int, default=256, help="MiB per bandwidth copy")
    ap.add_argument("--budget", type=int, default=450, help="seconds for the whole run")
    args = common.parse(ap, argv)
    args.workers = args.workers or ("8" if args.quick else "8,16,32")
    args.batches = args.batches or (10 if args.quick else 40)
    args.checks = args.checks or (8 if args.quick else 32)
    if not (args.json or args.out):
        args.json = "gpu-bench.json"
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine: nothing to check or measure "
              "(run it on a GPU machine)")
        return 2
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(args.budget)
    started = time.monotonic()
    name = torch.cuda.get_device_name()
    text: list[str] = []

    def say(block: str) -> None:  # printed now, and the whole report goes to --markdown
        print(block, flush=True)
        text.append(block)

    results: dict = {"device": name, "devices": torch.cuda.device_count(),
                     "date": time.strftime("%Y-%m-%d"),
                     "shm_free_gib": round(shm_free_bytes() / 2**30, 1), "checks": {}, "notes": []}
    say(f"# poolloader on {results['devices']}× {name}, torch {torch.__version__}, "
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
        for c in checks.values():
            corrupted |= bool(c["bad"]) or c["batches"] != args.checks
        say(writers.markdown_table(
            ["corruption check", "batches", "corrupted", "cooling waits / growths"],
            [(label, c["batches"], c["bad"] or "none",
              f"{c['stats']['cooling_waits']} / {c['stats']['cooling_growths']}")
             for label, c in checks.items()], align="lrlr"))

        nbytes = args.mib << 20
        if nbytes + DATA_OFF > shm_free_bytes() // 2:
            nbytes = max(1 << 20, (shm_free_bytes() // 4) >> 20 << 20)
            results["notes"].append(f"bandwidth copies shrunk to {nbytes >> 20} MiB (/dev/shm)")
        bw = results["bandwidth_GBps"] = bandwidth(nbytes, 10)
        say("\n" + writers.markdown_table(
            [f"H2D copy of {nbytes >> 20} MiB from", "GB/s median [min–max]", "is_pinned"],
            [(k, common.Summary(v["median"], v["min"], v["max"], v["n"]).fmt(".2f"), v["is_pinned"])
             for k, v in bw.items()], align="lrl"))

        gc_ = results["gate_cost"] = gate_cost()
        say(f"\ngate: {gc_['release_us']:.1f} µs per release ({gc_['known_streams']} torch streams "
              f"known on the device, devices with a context {gc_['devices_with_context']}); "
              f"ready() over {200} keys {gc_['ready_us_for_all']:.0f} µs")

        raw = throughput([int(w) for w in args.workers.split(",")], args.batches, args.reps,
                         results["notes"])
        results["throughput_img_s"] = {"raw": raw.as_json(),
                                       "summary": common.summaries(raw, ["img_s"], ARMS[0])}
        say("\n" + writers.markdown_table(
            ["workers", *(f"{a} img/s" for a in ARMS), *(f"{a} / DataLoader" for a in ARMS[1:])],
            [(w, *(common.cell_text(raw, w, a, "img_s") for a in ARMS),
              *(common.ratio_text(raw, w, a, ARMS[0], "img_s") for a in ARMS[1:])) for w in raw.cells]))
        say("\nCPU ms per batch on the main thread (next(), del and the .to() copies issued; "
            "the GPU's time excluded) and on DataLoader's pin-memory thread, which PoolLoader "
            "does not have:\n\n" + writers.markdown_table(
                ["workers", *(f"{a} main" for a in ARMS), f"{ARMS[0]} pin thread"],
                [(w, *(common.cell_text(raw, w, a, "main_ms", ".3f") for a in ARMS),
                  common.cell_text(raw, w, ARMS[0], "pin_thread_ms", ".3f")) for w in raw.cells]))
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
        say(f"\nnote: {note}")
    if args.markdown:
        writers.write_text(args.markdown, "\n".join(text))
    if args.json:
        writers.write_json(args.json, {"bench": "gpu", "config": vars(args), **results})
    print(f"\n{results['elapsed_s']} s; RESULT:", {0: "PASS", 1: "FAIL: corrupted batches",
                                                   3: "INCOMPLETE (budget)", 4: "ERROR"}[status])
    return status


if __name__ == "__main__":
    sys.exit(main())
