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
clock starts, so start-up, imports and mapping are never timed. ``--reps``
rounds run every arm of every measure once, the arms in an order rotated each
round (no arm always goes first or follows the same neighbour): bench/common.py's
``interleave``, a measure being a cell. Reported per arm: median [min–max] over
the rounds, and how many times faster the ring is, paired per round (the arm's
time over the ring's, or the ring's rate over the arm's, in the same round).
Nothing is pinned to a CPU: on a small or busy machine the scheduler's
placement of the two processes is part of the result, which is why the spread
is shown. The clock is ``time.perf_counter``.

Usage::

    python bench/ring.py [--quick] [--reps 5] [--start-method fork] [--out DIR] [--json PATH]

``--quick`` shrinks the counts for a smoke run; ``--json`` writes every raw
number plus the configuration.
"""
import multiprocessing
import os
import signal
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import posix_ipc  # noqa: E402
import writers  # noqa: E402

from poolloader.shm._ring import Ring  # noqa: E402
from poolloader.shm._shm import Mapping  # noqa: E402

NAME = "ring"

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


def run(cfg) -> common.Raw:
    ctx = multiprocessing.get_context(cfg.start_method)

    def measure(name, arm, rep):
        return {"value": MEASURES[name][2](measure_once(arm, name, ctx, cfg), cfg)}

    return common.interleave(list(MEASURES), ARMS, measure, reps=cfg.reps,
                             warmup_reps=cfg.warmup_reps, label=NAME)


def speedup(raw: common.Raw, name: str, arm: str) -> common.Summary:
    """How many times faster the ring is than `arm`, paired per round."""
    if MEASURES[name][3]:  # a rate: ring / arm
        return common.ratio(raw, name, "ring", arm, "value")
    return common.ratio(raw, name, arm, "ring", "value")


def table(raw: common.Raw, cfg) -> str:
    head = (f"{cfg.round_trips:,} round trips (+{cfg.warmup:,} warm-up), {cfg.values:,} one-way "
            f"values, ring capacity {cfg.capacity}, {cfg.reps} rounds, start method "
            f"{cfg.start_method}; {writers.env_line()}")
    rows = []
    for name, (label, unit, _, _) in MEASURES.items():
        for i, arm in enumerate(ARMS):
            shown = "poolloader ring" if arm == "ring" else f"multiprocessing.{arm}"
            faster = "1" if arm == "ring" else speedup(raw, name, arm).fmt(".1f", "×")
            rows.append([f"{label} ({unit})" if i == 0 else "", shown,
                         common.cell_text(raw, name, arm, "value", ",.1f"), faster])
    return (f"### {NAME}\n\n{head}\n\n"
            + writers.markdown_table(["measure", "transport", "median [min–max]",
                                      "ring is N× faster"], rows, "llrr") + "\n")


def main(argv=None):
    parser = common.parser(NAME, __doc__, reps=(5, 3), warmup_reps=(0, 0))
    parser.add_argument("--round-trips", type=int, help="timed round trips (default 20,000)")
    parser.add_argument("--warmup", type=int, help="untimed round trips first (default 1,000)")
    parser.add_argument("--values", type=int, help="one-way values (default 200,000)")
    parser.add_argument("--capacity", type=int, default=1024, help="ring cells (default 1024)")
    parser.add_argument("--start-method", default="fork", choices=("fork", "spawn", "forkserver"))
    cfg = common.parse(parser, argv)
    quick = cfg.quick
    cfg.round_trips = cfg.round_trips or (2_000 if quick else 20_000)
    cfg.warmup = cfg.warmup if cfg.warmup is not None else (200 if quick else 1_000)
    cfg.values = cfg.values or (20_000 if quick else 200_000)

    raw = run(cfg)
    writers.write_outputs(cfg, table(raw, cfg), {
        "units": {m: MEASURES[m][1] for m in MEASURES}, "raw": raw.as_json(),
        "summary": {m: {arm: {"value": common.summarize(raw.series(m, arm, "value")).as_dict(),
                              "ring_speedup": speedup(raw, m, arm).as_dict()}
                        for arm in ARMS} for m in MEASURES}})


if __name__ == "__main__":
    main()
