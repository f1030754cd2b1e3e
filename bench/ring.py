"""Cross-process cost of poolloader's shared-memory ring next to multiprocessing.

What is measured, for three transports carrying the same int64 values (Python
ints 0, 1, 2, ...) between the parent and one child process:

* ``ring``:  two poolloader rings (parent->child, child->parent) in one POSIX
  shared-memory segment; blocking ``push``/``pop`` (GIL released while waiting).
* ``Pipe``:  one duplex ``multiprocessing.Pipe``; ``send``/``recv`` (pickles each int).
* ``Queue``: two ``multiprocessing.Queue``; ``put``/``get`` (feeder thread, pickling,
  a lock and a pipe under each).

Measures:

* ping-pong round trip: the parent sends i, the child sends it straight back, the
  parent waits for it (and checks it) before sending i+1. After ``--warmup``
  untimed round trips, ``--round-trips`` are timed; reported: µs per round trip.
* one-way throughput: the parent sends 0..N-1 (``--values``) as fast as the
  transport takes them; the child receives them all, checking the order, then
  acknowledges on the back channel. Timed from the first send to the
  acknowledgement; reported: values per second. The ring holds ``--capacity``
  values, a Pipe what the kernel buffers (64 KiB), a Queue is unbounded.

Method: every measurement starts a fresh child (start method ``--start-method``,
fork by default) that says READY through the transport under test before the
clock starts, so start-up, imports and mapping are never timed. ``--repeat``
rounds run every arm of every measure once, the arms in an order rotated each
round (no arm always goes first or follows the same neighbour). Reported per
arm: median [min–max] over the rounds, and how many times faster the ring is
(the arm's median time over the ring's, or the ring's median rate over the
arm's). Nothing is pinned to a CPU: on a small or busy machine the scheduler's
placement of the two processes is part of the result, which is why the spread
is shown. The clock is ``time.perf_counter``.

Usage::

    python bench/ring.py [--quick] [--json PATH] [--repeat 5] [--start-method fork]

``--quick`` shrinks the counts for a smoke run; ``--json`` writes every raw
number plus the configuration.
"""
import argparse
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import time
import uuid

import posix_ipc

from poolloader._ring import Ring
from poolloader._shm import Mapping

ARMS = ("ring", "Pipe", "Queue")
READY, DONE = -1, -2
ALARM_S = 120  # no single measurement may take longer: a lost child fails, never hangs


# ---------------------------------------------------------------- transports


def _ring_layout(capacity):
    ring_bytes = (Ring.nbytes(capacity) + 63) // 64 * 64
    return (0, ring_bytes), 2 * ring_bytes


def _open_parent(arm, ctx, capacity):
    """Parent side of `arm`: (send, recv, what the child needs, after_ready, close)."""
    if arm == "ring":
        (down_at, up_at), nbytes = _ring_layout(capacity)
        name = f"/plbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
        try:
            memory = Mapping(shm.fd, nbytes)
        finally:
            shm.close_fd()
        down = Ring(memory, down_at, capacity=capacity)
        up = Ring(memory, up_at, capacity=capacity)
        unlinked = []

        def unlink():
            if not unlinked:
                unlinked.append(True)
                shm.unlink()

        if ctx.get_start_method() == "fork":
            unlink()  # the child inherits the mapping
            endpoint = (memory, nbytes, down_at, up_at)
        else:
            endpoint = (name, nbytes, down_at, up_at)
        return down.push, up.pop, endpoint, unlink, unlink
    if arm == "Pipe":
        mine, theirs = ctx.Pipe(duplex=True)

        def close():
            mine.close()
            theirs.close()

        return mine.send, mine.recv, theirs, theirs.close, close
    if arm == "Queue":
        down, up = ctx.Queue(), ctx.Queue()

        def close():
            for queue in (down, up):
                queue.close()
                queue.join_thread()

        return down.put, up.get, (down, up), lambda: None, close
    raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")


def _open_child(arm, endpoint):
    """Child side of `arm`: (send, recv)."""
    if arm == "ring":
        memory, nbytes, down_at, up_at = endpoint
        if isinstance(memory, str):
            shm = posix_ipc.SharedMemory(memory)
            try:
                memory = Mapping(shm.fd, nbytes)
            finally:
                shm.close_fd()
        return Ring(memory, up_at).push, Ring(memory, down_at).pop
    if arm == "Pipe":
        return endpoint.send, endpoint.recv
    down, up = endpoint
    return up.put, down.get


def _child(arm, endpoint, measure, count):
    signal.alarm(ALARM_S)  # default action: die, if the parent vanished
    send, recv = _open_child(arm, endpoint)
    send(READY)
    if measure == "round_trip":
        for _ in range(count):
            send(recv())
    else:
        for expected in range(count):
            value = recv()
            if value != expected:
                raise SystemExit(f"{arm}: received {value}, expected {expected}")
        send(DONE)


# ---------------------------------------------------------------- one measurement


def _alarm(signum, frame):
    raise TimeoutError(f"a measurement took longer than {ALARM_S} s (child lost?)")


def measure_once(arm, measure, ctx, cfg):
    """One timed run of `measure` over `arm` in a fresh child; returns seconds."""
    send, recv, endpoint, after_ready, close = _open_parent(arm, ctx, cfg.capacity)
    count = cfg.warmup + cfg.round_trips if measure == "round_trip" else cfg.values
    child = ctx.Process(target=_child, args=(arm, endpoint, measure, count), daemon=True)
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    child.start()
    try:
        after_ready_needed = recv()
        if after_ready_needed != READY:
            raise RuntimeError(f"{arm}: child said {after_ready_needed}, expected READY")
        after_ready()
        if measure == "round_trip":
            for i in range(cfg.warmup):
                send(i)
                recv()
            start = time.perf_counter()
            for i in range(cfg.warmup, count):
                send(i)
                if recv() != i:
                    raise RuntimeError(f"{arm}: round trip {i} came back wrong")
            elapsed = time.perf_counter() - start
        else:
            start = time.perf_counter()
            for i in range(count):
                send(i)
            if recv() != DONE:
                raise RuntimeError(f"{arm}: no DONE from the child")
            elapsed = time.perf_counter() - start
        child.join(30)
        if child.exitcode != 0:
            raise RuntimeError(f"{arm}: child pid {child.pid} exited with {child.exitcode}")
        return elapsed
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        if child.is_alive():
            child.kill()
            child.join(5)
        after_ready()  # (ring) unlink if the child never got that far
        close()


# ---------------------------------------------------------------- the run

MEASURES = {
    # name: (label, unit, value from (seconds, cfg), higher is better)
    "round_trip": ("ping-pong round trip", "µs", lambda s, c: s / c.round_trips * 1e6, False),
    "throughput": ("one-way throughput", "k values/s", lambda s, c: c.values / s / 1e3, True),
}


def run(cfg):
    ctx = multiprocessing.get_context(cfg.start_method)
    raw = {m: {arm: [] for arm in ARMS} for m in MEASURES}
    for rnd in range(cfg.repeat):
        order = ARMS[rnd % len(ARMS):] + ARMS[:rnd % len(ARMS)]
        for measure, (_, _, value_of, _) in MEASURES.items():
            for arm in order:
                seconds = measure_once(arm, measure, ctx, cfg)
                raw[measure][arm].append(value_of(seconds, cfg))
        print(f"round {rnd + 1}/{cfg.repeat} done", file=sys.stderr)
    return raw


def summarise(raw):
    summary = {}
    for measure, (_, _, _, higher_better) in MEASURES.items():
        ring_median = statistics.median(raw[measure]["ring"])
        summary[measure] = {}
        for arm in ARMS:
            values = raw[measure][arm]
            median = statistics.median(values)
            speedup = median / ring_median if not higher_better else ring_median / median
            summary[measure][arm] = {"median": median, "min": min(values),
                                     "max": max(values), "ring_speedup": speedup}
    return summary


def table(summary, cfg):
    lines = [
        f"{cfg.round_trips:,} round trips (+{cfg.warmup:,} warm-up), {cfg.values:,} one-way "
        f"values, ring capacity {cfg.capacity}, {cfg.repeat} rounds, start method "
        f"{cfg.start_method}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        "| measure | transport | median | [min–max] | ring is N× faster |",
        "|---|---|---:|---:|---:|",
    ]
    for measure, (label, unit, _, _) in MEASURES.items():
        for i, arm in enumerate(ARMS):
            s = summary[measure][arm]
            name = f"{label} ({unit})" if i == 0 else ""
            shown = "poolloader ring" if arm == "ring" else f"multiprocessing.{arm}"
            lines.append(f"| {name} | {shown} | {s['median']:,.1f} | "
                         f"[{s['min']:,.1f}–{s['max']:,.1f}] | {s['ring_speedup']:.1f}× |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, 3 rounds")
    parser.add_argument("--json", metavar="PATH", help="write raw numbers and config here")
    parser.add_argument("--repeat", type=int, help="rounds (default 5, quick 3)")
    parser.add_argument("--round-trips", type=int, help="timed round trips (default 20,000)")
    parser.add_argument("--warmup", type=int, help="untimed round trips first (default 1,000)")
    parser.add_argument("--values", type=int, help="one-way values (default 200,000)")
    parser.add_argument("--capacity", type=int, default=1024, help="ring cells (default 1024)")
    parser.add_argument("--start-method", default="fork", choices=("fork", "spawn", "forkserver"))
    cfg = parser.parse_args(argv)
    quick = cfg.quick
    cfg.repeat = cfg.repeat or (3 if quick else 5)
    cfg.round_trips = cfg.round_trips or (2_000 if quick else 20_000)
    cfg.warmup = cfg.warmup if cfg.warmup is not None else (200 if quick else 1_000)
    cfg.values = cfg.values or (20_000 if quick else 200_000)

    raw = run(cfg)
    summary = summarise(raw)
    print(table(summary, cfg))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"config": vars(cfg), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "platform": platform.platform(),
                       "units": {m: MEASURES[m][1] for m in MEASURES},
                       "raw": raw, "summary": summary}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
