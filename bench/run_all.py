"""Run every benchmark and collect the tables in one results folder.

Runs, one after the other, each as its own subprocess (a fresh interpreter and
its own session, so a crash, a hang or a leak in one cannot touch the next):

  workers   bench/workers.py   img/s vs num_workers, DataLoader vs PoolLoader
  payload   bench/payload.py   1 MiB -> 256 MiB batches: main ms/batch, GiB/s
  train     bench/train.py     examples/train_detector.py end to end, img/s
  handoff   bench/handoff.py   the headline hand-off ablation
  stages    bench/stages.py    a batch's main-thread and worker cost, stage by stage
  keep      bench/keep.py      the consumer keeps every batch: main ms, shm held
  fd_limits bench/fd_limits.py descriptor limits
  ring      bench/ring.py      ring vs multiprocessing Pipe/Queue
  shards    bench/shards.py    sharded / WebDataset-style data

Six benchmarks on the same runner are left out, to be run by hand:
bench/gpu.py needs CUDA (it exits 2 without it); bench/state.py and
bench/throughput.py compare this tree with a git revision (`--baseline`), which
a shallow clone may lack; bench/startup.py pickles hundreds of MB per worker
start under spawn and forkserver (minutes); bench/memory.py does both (a
revision, and gigabytes pickled into workers); bench/node.py runs torchrun jobs
of 2 and 4 ranks, each with its own workers (minutes).

Each benchmark's own docstring states its method; all run DataLoader and
PoolLoader side by side in the same process run. Every one parses its command
line with bench/common.py's shared parser, so this script gives each the same
flags (`common.runner_argv`): `--out <out>` (each writes `<name>.md`,
`<name>.json` and `<name>.png` there), `--quick` and `--reps` when given here.
Every benchmark's stdout is kept as `<name>.stdout.txt` (and stands in for
`<name>.md` if it wrote none, e.g. it crashed); its stderr (progress) goes to
`<name>.log`.

After each run: its exit status and wall time are recorded; names left in
/dev/shm carrying the pid of any process of its session, and processes of its
session still alive, are reported (and those processes killed by pid). The
folder gets `README.md` (every table, in order, with status, timing and the
machine's load average before and after each run: other work on the machine
shows up there) and `run_all.json`.

Usage:
    python bench/run_all.py [--quick] [--reps N] [--out results/] [--only workers,train]
                            [--skip ring] [--timeout 600]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import writers  # noqa: E402

BENCH = os.path.dirname(os.path.abspath(__file__))
BENCHES = [
    ("workers", "throughput vs num_workers"),
    ("payload", "payload size sweep"),
    ("train", "end-to-end training (examples/train_detector.py)"),
    ("handoff", "worker -> main hand-off ablation (headline)"),
    ("stages", "per-stage cost of a batch, main thread and worker"),
    ("keep", "the consumer keeps every batch"),
    ("fd_limits", "file-descriptor limits"),
    ("ring", "ring vs multiprocessing"),
    ("shards", "sharded data"),
]


def run_one(name: str, args) -> dict:
    script = os.path.join(BENCH, f"{name}.py")
    entry = {"name": name, "script": os.path.relpath(script, common.REPO)}
    out = args.out
    for ext in ("md", "json", "png", "stdout.txt"):  # a crash must not pass off an old table
        path = os.path.join(out, f"{name}.{ext}")
        if os.path.exists(path):
            os.unlink(path)
    cmd = [sys.executable, script, *common.runner_argv(out, args.quick, args.reps)]
    entry["command"] = " ".join(os.path.relpath(c, common.REPO) if c.startswith(common.REPO) else c
                                for c in cmd[1:])
    log_path = os.path.join(out, f"{name}.log")
    entry["load_before"] = os.getloadavg()
    seen = set()
    start = time.monotonic()
    print(f"[run_all] {name}: {entry['command']}", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                cwd=common.REPO, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
            entry["status"] = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            seen.update(procs.session_pids(proc.pid))
            os.killpg(proc.pid, signal.SIGKILL)  # the session this script started
            stdout, _ = proc.communicate()
            entry["status"] = f"timed out after {args.timeout} s"
    entry["wall_s"] = round(time.monotonic() - start, 1)
    entry["load_after"] = os.getloadavg()
    # Leftovers of the benchmark's session (its workers, spawned helpers).
    seen.add(proc.pid)
    deadline = time.monotonic() + 10
    while True:
        alive = procs.session_pids(proc.pid)
        seen.update(alive)
        names = procs.names_of(seen)
        if not (alive or names) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if alive:
        entry["left_processes"] = alive
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if names:
        entry["left_shm_names"] = names
    writers.write_text(os.path.join(out, f"{name}.stdout.txt"), stdout)
    files = {ext: os.path.join(out, f"{name}.{ext}") for ext in ("md", "json", "png")}
    if not os.path.exists(files["md"]):
        writers.write_text(files["md"], f"### {name}\n\n{stdout.strip()}\n")
    entry["files"] = {k: os.path.relpath(v, out) for k, v in files.items() if os.path.exists(v)}
    pngs = sorted(f for f in os.listdir(out) if f.startswith(name) and f.endswith(".png"))
    entry["plots"] = pngs
    entry["log"] = os.path.relpath(log_path, out)
    print(f"[run_all] {name}: {entry['status']} in {entry['wall_s']} s", file=sys.stderr, flush=True)
    return entry


def index(entries, args, total_s) -> str:
    lines = [
        "# poolloader benchmark results",
        "",
        f"`python bench/run_all.py{' --quick' if args.quick else ''}` — {writers.env_line()}; "
        f"total {total_s:.0f} s. Every table compares torch's DataLoader and PoolLoader run "
        "side by side in one process run; each benchmark's docstring states its method. "
        "Absolute numbers on a shared 2-core machine are noise; the paired ratios are the figures. "
        "Load average (1 min) before → after each run shows other work on the machine.",
        "",
        writers.markdown_table(
            ["benchmark", "status", "wall s", "load before → after", "files"],
            [[e["name"], e["status"], e.get("wall_s", "–"),
              (f"{e['load_before'][0]:.1f} → {e['load_after'][0]:.1f}" if "load_before" in e
               else "–"),
              ", ".join(sorted(set(e.get("files", {}).values()) | set(e.get("plots", []))))]
             for e in entries], "llrll"),
        "",
    ]
    for e in entries:
        problems = []
        if e.get("left_processes"):
            problems.append(f"processes left alive (killed): {e['left_processes']}")
        if e.get("left_shm_names"):
            problems.append(f"names left in /dev/shm: {e['left_shm_names']}")
        lines.append(f"## {e['name']}")
        lines.append("")
        lines.append(f"`{e['command']}` — {e['status']}, {e['wall_s']} s")
        lines.append("")
        if problems:
            lines += ["**Leftovers:** " + "; ".join(problems), ""]
        md = os.path.join(args.out, e["files"].get("md", ""))
        if e.get("files", {}).get("md") and os.path.exists(md):
            with open(md) as f:
                lines += [f.read().strip(), ""]
        for png in e.get("plots", []):
            lines += [f"![{png}]({png})", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every benchmark's --quick (~10 min in all)")
    p.add_argument("--reps", "--repeats", dest="reps", type=int, default=None,
                   help="every benchmark's --reps (default: each its own)")
    p.add_argument("--out", default=common.DEFAULT_RESULTS, help="results folder (default results/)")
    p.add_argument("--only", default=None, help="comma-separated benchmark names")
    p.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per benchmark before it is killed (default 300; full 3600)")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    args.timeout = args.timeout or (300 if args.quick else 3600)
    os.makedirs(args.out, exist_ok=True)
    names = [n for n, _ in BENCHES]
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(names)
        if unknown:
            p.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {names}")
        names = [n for n in names if n in wanted]
    names = [n for n in names if n not in set(args.skip.split(","))]

    start = time.monotonic()
    entries = [run_one(name, args) for name in names]
    total = time.monotonic() - start
    text = index(entries, args, total)
    writers.write_text(os.path.join(args.out, "README.md"), text)
    writers.write_json(os.path.join(args.out, "run_all.json"),
                       {"quick": args.quick, "total_s": total, "benchmarks": entries})
    print(text)
    failed = [e["name"] for e in entries if e["status"] != "ok"]
    if failed:
        print(f"[run_all] failed: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
