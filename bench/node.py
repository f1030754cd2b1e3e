"""One pool per node: the local ranks of a torchrun job, each with its own DataLoader,
its own PoolLoader, PoolLoader(node_pool=True) (one set of worker processes for the
node, hosted by local rank 0) or PoolLoader(share_batches=every rank) (ranks that draw
the same batches get each made once), side by side in one run.

The question it answers: with `R` local ranks each asking for `num_workers=2`, how many
processes does the job run, how much memory and worker CPU does the node spend, and what
does sharing the workers (or the batches) cost each rank's batches/s, first batch and
main thread?

Arms (same data set, same sampler, same collate: `workload.RFDETRShaped` /
`workload.RFDETRCollate`, RF-DETR's batch of 16 × 576², row `per_sample` by default):
  torch  DataLoader per rank, num_workers=2
  pool   PoolLoader per rank, num_workers=2
  node   PoolLoader(num_workers=2, node_pool=True), plus node_workers=N with
         `--node-workers N` (`total`: ranks × num_workers, the per-rank arms' worker
         count). A tree whose PoolLoader refuses the keyword (TypeError) gives FAILED
         with that error, and the run goes on.
  share  PoolLoader(num_workers=2, share_batches=list(range(R))): rank 0 (the leader)
         runs its workers, the other ranks map its slots. Only with `--same-batches`
         (refused otherwise: share_batches errors at the first batch whose indices differ).

`--same-batches` gives every rank of every arm DistributedSampler(num_replicas=1,
rank=0) instead of its share of the data: the ranks then consume identical batches, as
a tensor-parallel group does, and pool (each rank makes them itself) is share's
baseline. It is an option, not a second pool arm, so that one run's arms all draw the
same data and the ÷ columns pair like with like; without it the table is what it was.

Method. A cell is a rank count (`--ranks 2,4`). For every cell, arm and repetition
(`common.interleave`: arms back to back, the order rotated per repetition and cell) the
driver starts `python -m torch.distributed.run --standalone --nproc_per_node=R
bench/node.py --rank-child SPEC` in a session of its own, with a deadline (`--timeout`:
past it every process of the job is killed by pid and the arm is FAILED). Each rank:
  1. joins a gloo process group (its timeout is the deadline too), builds a
     DistributedSampler(shuffle=True, seed) over the data set (its own share, or with
     `--same-batches` everything, as rank 0 of one replica) and its arm's loader (fork
     workers, `timeout=` on the loader: a stuck worker raises);
  2. after a barrier, times iter() to the first batch ("first batch s"); barrier, and
     rank 0 reads the CPU time of the job's worker processes (below), barrier;
  3. draws `--warmup-batches` untimed batches, then `--batches` timed ones, `next()`
     then `del` (the consumer does nothing else): batches/s over that window, and the
     median over batches of the main thread's CPU ms for `next()` + `del`
     (`time.thread_time`: what receiving and releasing a batch costs the training
     thread, not the time it waits);
  4. barrier (every rank done, every iterator still alive); rank 0 (local rank 0: one
     node) reads the workers' CPU again, then takes the census: the job's processes are
     every live (non-zombie) descendant of torchrun, plus every live process in
     torchrun's session or a rank's session (torchrun starts each rank as a session
     leader; its workers inherit the session even if reparented), torchrun itself
     excluded: the ranks, the loaders' workers and any helper a loader starts. "worker
     processes" is that minus the ranks. "node PSS" sums their Pss
     (/proc/<pid>/smaps_rollup, read by poolloader.main.memory.read_process): each
     shared page is divided among the processes that map it, so the sum is what the job
     holds together (torchrun's own PSS is in the JSON, not in the sum). "workers' CPU
     ms per delivered batch" is what the worker processes' CPU time (procs.cpu_ns:
     every live thread's, /proc/<pid>/task/*/schedstat, ns) grew by between the two
     readings, over the batches every rank delivered in between (R × (warm-up +
     timed)). Both readings wait, every other rank held in the barrier, until no
     worker's CPU grows by more than SETTLED_CPU_MS in SETTLE_STEP_S: every pipeline is
     full and idle, so the batches made in between are the batches asked for in
     between, one per delivered batch of a rank that makes its own (one per leader's
     batch under share). The worker processes must be the same at both readings and no
     thread of theirs may exit in between (else the job FAILS); worker start-up (before
     the first batch) is outside the window. Filling the pipelines before the warm-up
     leaves the timed window a fuller pipeline at its start than a run without the
     reading would;
  5. barrier, shuts its iterator down, barrier, destroy_process_group; writes its
     figures to a file the driver reads.
After torchrun exits the driver waits (10 s at most) until no process of the job's
sessions is alive and no /dev/shm name carrying one of the job's pids is left; an arm
that leaves either is FAILED (and what it left is killed, by pid).

Reported per rank count and arm: worker processes, job processes, node PSS (and the
workers' share of it), first batch, batches/s, main-thread CPU ms per batch and workers'
CPU ms per delivered batch. The per-rank ones are median [min–max] over every rank of
every repetition; the others over repetitions. Ratio columns pair the arms of one
repetition (per-rank metrics: the median over ranks), then summarise. Targets (set for
4 ranks; shown for every rank count): the node arm's job processes ≤ num_workers +
ranks + 1 (7 at 4 ranks, with the default node_workers); node PSS ≤ 0.5 × PoolLoader
per rank's; batches/s per rank ≥ 0.9 × PoolLoader per rank's with the same total worker
count (comparable only when the node arm runs ranks × num_workers workers:
`--node-workers total`); with `--same-batches`, share's workers' CPU per delivered
batch ≤ 0.3 × pool's (R ranks sharing make each batch once, so about 1/R is expected:
0.25 at 4 ranks, 0.5 at 2; a worker's CPU per batch made varies by ±25% from job to job
on a shared 2-core machine, so take repetitions).

Process counts and PSS hardly depend on the machine's load; times do, and R ranks with
their workers on a 2-core machine share two cores: compare the ratios inside one run.

Usage:
    python bench/node.py [--quick] [--ranks 2,4] [--num-workers 2] [--node-workers N|total]
                         [--arms torch,pool,node] [--same-batches [--arms pool,share]]
                         (default arms: torch,pool,node; with --same-batches also share)
                         [--batches 20] [--warmup-batches 4]
                         [--row per_sample] [--resolution 576] [--timeout 300] [--out DIR]
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

NAME = "node"
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
MIB = 1 << 20
ARMS = ("torch", "pool", "node", "share")
ARM_LABEL = {"torch": "DataLoader per rank", "pool": "PoolLoader per rank",
             "node": "PoolLoader node pool", "share": "PoolLoader share_batches"}
SAME_BATCHES_ONLY = ("share",)  # arms that need every rank's sampler to give the same batches
PER_RANK = ("first_s", "batch_s", "main_cpu_ms")  # each rank's; the job's: the rest
ZOMBIE = (b"Z", b"X", b"x")
CLEAN_WAIT_S = 10.0
# The workers' CPU is read once their pipelines are full: when no worker's CPU time grows
# by more than SETTLED_CPU_MS over SETTLE_STEP_S, within SETTLE_TIMEOUT_S. An idle
# PoolLoader worker takes ~0.75 ms per 0.5 s (its 0.25 s tick: parent alive?, mappings,
# stall check); a batch here takes a worker 25 ms or more.
SETTLE_STEP_S = 0.5
SETTLED_CPU_MS = 2.0
SETTLE_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------
# the job's processes (the driver and rank 0 both take this census)

def job_census(root: int, sessions=()) -> dict:
    """{pid: Proc} of the job's live processes: every live descendant of `root`
    (torchrun), and every live process in `root`'s session, in one of `sessions` or in
    a descendant's session (torchrun makes each rank a session leader; a worker
    reparented after its rank died keeps the rank's session); `root` excluded."""
    import procs

    table = procs.processes()
    children: dict = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    leaders = {root, *sessions} | {table[p].session for p in found}
    found |= {pid for pid, proc in table.items() if proc.session in leaders}
    found.discard(root)
    return {pid: table[pid] for pid in sorted(found) if table[pid].state not in ZOMBIE}


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------
# one rank, started by torchrun

def _write(path: str, payload: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def rank_child(spec: dict) -> None:
    """One rank: figures (or the error that stopped it) to <out_dir>/rank-<rank>.json."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    out = os.path.join(spec["out_dir"], f"rank-{rank}.json")
    _write(os.path.join(spec["out_dir"], f"rank-{rank}.pid"), {"pid": os.getpid()})
    sys.path.insert(0, os.path.dirname(HERE))
    import datetime

    import common
    import torch.distributed as dist

    result: dict = {"rank": rank, "local_rank": local_rank, "pid": os.getpid()}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        result.update(_rank_body(spec, rank, world, local_rank))
    except Exception as exc:
        result["error"] = common.error_text(exc)
        _write(out, result)
        raise
    finally:
        dist.destroy_process_group()
    _write(out, result)


def _rank_body(spec: dict, rank: int, world: int, local_rank: int) -> dict:
    import torch.distributed as dist
    import workload
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from poolloader import PoolLoader
    from poolloader.main.memory import read_process

    arm, workers, same = spec["arm"], spec["num_workers"], spec["same_batches"]
    if arm in SAME_BATCHES_ONLY and not same:
        raise RuntimeError(f"the {arm} arm needs identical samplers on every rank "
                           "(share_batches checks each batch's indices): pass --same-batches")
    in_flight = 2 * workers + 2  # what a pipeline holds beyond the batches drawn
    per_rank = spec["warmup_batches"] + spec["batches"] + 1 + in_flight
    dataset = workload.RFDETRShaped(workload.BATCH * world * per_rank, resolution=spec["resolution"])
    # --same-batches: every rank draws what rank 0 of a one-replica sampler draws
    sampler = DistributedSampler(dataset, num_replicas=1 if same else world,
                                 rank=0 if same else rank, shuffle=True, seed=spec["seed"])
    kwargs: dict = dict(batch_size=workload.BATCH, sampler=sampler, num_workers=workers,
                        collate_fn=workload.RFDETRCollate(spec["row"], pool=arm != "torch"),
                        timeout=spec["loader_timeout"])
    if arm == "node":
        kwargs["node_pool"] = True
        if spec["node_workers"] is not None:
            kwargs["node_workers"] = spec["node_workers"]
    if arm == "share":
        kwargs["share_batches"] = list(range(world))
    loader = (DataLoader if arm == "torch" else PoolLoader)(dataset, **kwargs)
    rank_pids: list = [None] * world
    dist.all_gather_object(rank_pids, os.getpid())
    out: dict = {}
    dist.barrier()  # every rank starts its loader at once
    t0 = time.perf_counter()
    it = iter(loader)
    try:
        batch = next(it)
        out["first_s"] = time.perf_counter() - t0
        del batch
        dist.barrier()  # every rank has its first batch: every worker is up
        if local_rank == 0:
            cpu0 = _settled_worker_cpu(os.getppid(), rank_pids)
        dist.barrier()  # the workers' CPU is read: the CPU window opens
        for _ in range(spec["warmup_batches"]):
            batch = next(it)
            del batch
        cpu_ms = []
        start = time.perf_counter()
        for _ in range(spec["batches"]):
            c0 = time.thread_time()
            batch = next(it)
            del batch
            cpu_ms.append((time.thread_time() - c0) * 1e3)
        wall = time.perf_counter() - start
        out["batch_s"] = spec["batches"] / wall
        out["main_cpu_ms"] = statistics.median(cpu_ms)
        dist.barrier()  # every rank is past its timed window, every iterator alive
        memory = getattr(getattr(loader, "stats", None), "memory", None)
        if memory is not None:  # this rank's pool: resident of reserved (issue 45)
            report = memory()
            out["pool_resident_mib"] = getattr(report, "pool_resident", 0) / MIB
            out["pool_reserved_mib"] = getattr(report, "pool_reserved", 0) / MIB
            out["pool_slots"] = loader.stats.slot_count
        if local_rank == 0:
            cpu1 = _settled_worker_cpu(os.getppid(), rank_pids)
            delivered = world * (spec["warmup_batches"] + spec["batches"])
            out.update(_worker_cpu(cpu0, cpu1, delivered))
            out.update(_census(os.getppid(), rank_pids, read_process))
            out.update(_cgroup_now(spec.get("cgroup")))
        dist.barrier()  # the census is taken
    finally:
        workload.shutdown_iterator(it)
        del it
    dist.barrier()  # every rank has shut its loader down
    return out


def _settled_worker_cpu(torchrun: int, rank_pids: list) -> dict:
    """{pid: CPU ns} of the job's worker processes (the census less the ranks), read
    once their pipelines are full (see SETTLE_STEP_S); rank 0 calls it while the
    other ranks wait in a barrier, so no rank asks for a batch meanwhile."""
    import procs

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    before = None
    grew_ms = float("nan")
    while True:
        now = {pid: procs.cpu_ns(pid) for pid in job_census(torchrun, rank_pids)
               if pid not in rank_pids}
        if before is not None and now.keys() == before.keys():
            grew_ms = max((now[pid] - before[pid]) / 1e6 for pid in now) if now else 0.0
            if grew_ms <= SETTLED_CPU_MS:
                return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers {sorted(now)} did not go idle within "
                               f"{SETTLE_TIMEOUT_S:.0f} s (SETTLE_TIMEOUT_S) of the ranks' barrier: "
                               f"one's CPU grew by more than {SETTLED_CPU_MS} ms (SETTLED_CPU_MS) "
                               f"every {SETTLE_STEP_S} s, {grew_ms:.1f} ms the last time")
        before = now
        time.sleep(SETTLE_STEP_S)


def _worker_cpu(cpu0: dict, cpu1: dict, delivered: int) -> dict:
    """The workers' CPU between two settled readings, per batch the ranks delivered."""
    if cpu0.keys() != cpu1.keys():
        raise RuntimeError(f"worker processes changed inside the CPU window: started "
                           f"{sorted(cpu1.keys() - cpu0.keys())}, gone "
                           f"{sorted(cpu0.keys() - cpu1.keys())}")
    shrank = sorted(pid for pid in cpu0 if cpu1[pid] < cpu0[pid])
    if shrank:
        raise RuntimeError(f"a thread of worker process(es) {shrank} exited inside the CPU "
                           "window (procs.cpu_ns counts live threads only)")
    total_ms = sum(cpu1[pid] - cpu0[pid] for pid in cpu0) / 1e6
    return {"worker_cpu_ms": total_ms / delivered, "worker_cpu_s": total_ms / 1e3,
            "delivered": delivered}


def _status_kib(pid: int) -> dict:
    """RssAnon, RssFile, RssShmem (/proc/<pid>/status) and Pss_Anon, Pss_File,
    Pss_Shmem (smaps_rollup) of `pid`, kB: the account's training processes and
    workers' base are their Pss_Anon (anonymous pages a fork shares divided among the
    processes that share them, so the sums add up to the cgroup's anon)."""
    out = {"rank": False}
    for name, keys in (("status", ("RssAnon", "RssFile", "RssShmem")),
                       ("smaps_rollup", ("Pss_Anon", "Pss_File", "Pss_Shmem"))):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in keys:
                        out[key] = int(value.split()[0])
        except OSError:
            pass
    return out


def _cgroup_now(path) -> dict:
    """The job's cgroup's charge at the census (every pipeline full), by kind: what the
    account in docs/benchmarks.md splits (cgroups.MemoryCgroup.stat)."""
    import cgroups

    if path is None:
        return {}
    group = cgroups.MemoryCgroup(path, os.path.exists(os.path.join(path, "memory.usage_in_bytes")), "")
    stat = group.stat()
    return {"cgroup_now_mib": group.current() / MIB,
            **{f"cgroup_{kind}_mib": value / MIB for kind, value in stat.items()}}


def _census(torchrun: int, rank_pids: list, read_process) -> dict:
    """The job's processes and their PSS, as seen from rank 0 (see the module docstring)."""
    import procs

    if "torch.distributed" not in procs.cmdline(torchrun) and "torchrun" not in procs.cmdline(torchrun):
        raise RuntimeError(f"rank 0's parent (pid {torchrun}: {procs.cmdline(torchrun)[:80]!r}) "
                           "is not torchrun; run this file through bench/node.py's driver")
    job = job_census(torchrun, rank_pids)
    missing = sorted(set(rank_pids) - set(job))
    if missing:
        raise RuntimeError(f"internal error: ranks {missing} are not among the job's processes "
                           f"{sorted(job)}")
    memory = {pid: read_process(pid) for pid in job}
    unread = sorted(pid for pid, m in memory.items() if m is None)
    if unread:
        raise RuntimeError(f"could not read /proc/<pid>/smaps_rollup of {unread} (exited?)")
    ranks_pss = sum(memory[p]["pss"] for p in rank_pids)
    total_pss = sum(m["pss"] for m in memory.values())
    own = read_process(torchrun)
    return {"processes": len(job), "workers": len(job) - len(rank_pids),
            "pss_mib": total_pss / MIB, "rank_pss_mib": ranks_pss / MIB,
            "worker_pss_mib": (total_pss - ranks_pss) / MIB,
            "torchrun_pss_mib": None if own is None else own["pss"] / MIB,
            "job_pids": sorted(job),
            "status_kib": {pid: _status_kib(pid) for pid in job},
            "others": [f"{pid} (parent {job[pid].ppid}): "
                       f"{procs.cmdline(pid).split(' --rank-child')[0][:100]}"
                       for pid in job if pid not in rank_pids]}


# ---------------------------------------------------------------------------
# the driver: one torchrun job per measurement

def run_job(spec: dict, ranks: int, timeout: float) -> dict:
    """One torchrun job of `ranks` ranks; returns the measurement (job figures and
    per-rank lists); common.BenchError on a failed rank, the deadline, or leftovers."""
    import cgroups
    import common
    import procs

    tmp = tempfile.mkdtemp(prefix="plnode-")
    group, why_not = cgroups.MemoryCgroup.make(spec["arm"])
    spec = dict(spec, out_dir=tmp, cgroup=None if group is None else group.path)
    log_path = os.path.join(tmp, "torchrun.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", HERE, "--rank-child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    names0 = procs.shm_names()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=None if group is None else group.preexec())
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for _ in range(3):  # a rank may start a worker meanwhile: until none is left
                    job = job_census(proc.pid, _rank_pids(tmp))
                    kill_pids([proc.pid, *job])
                    time.sleep(0.2)
                proc.wait(timeout=30)
                raise common.BenchError(f"{spec['arm']}: the {ranks}-rank job ran past "
                                        f"{timeout:.0f} s (killed); its log ended: "
                                        f"{_tail(log_path)}") from None
        results = _read_results(tmp, ranks)
        errors = [f"{r['error']} (rank {r['rank']})" for r in results.values() if "error" in r]
        if errors:
            raise common.BenchError(errors[0])
        if proc.returncode or len(results) != ranks:
            raise common.BenchError(f"{spec['arm']}: torchrun exited {proc.returncode} with "
                                    f"{len(results)} of {ranks} ranks' figures; its log ended: "
                                    f"{_tail(log_path)}")
        rank_pids = sorted(r["pid"] for r in results.values())
        job_pids = set(results[0]["job_pids"]) | set(rank_pids)
        left = _leftovers(proc.pid, rank_pids, job_pids, names0)
        if left:
            raise common.BenchError(f"{spec['arm']}: the job left behind {', '.join(left)}")
        peak = None if group is None else group.peak() / MIB
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if group is not None:
            group.close()
    job = results[0]
    out = {k: job[k] for k in ("processes", "workers", "pss_mib", "rank_pss_mib",
                               "worker_pss_mib", "torchrun_pss_mib", "others",
                               "worker_cpu_ms", "worker_cpu_s", "delivered")}
    out["status_kib"] = {pid: dict(v, rank=int(pid) in rank_pids)
                         for pid, v in job.get("status_kib", {}).items()}
    out["cgroup_peak_mib"] = peak
    out["cgroup_skipped"] = why_not
    out.update({k: v for k, v in job.items() if k.startswith("cgroup_")})
    ordered = [results[r] for r in sorted(results)]
    for metric in PER_RANK:
        values = [r[metric] for r in ordered]
        out[metric] = statistics.median(values)  # what the ratios pair
        out[f"rank_{metric}"] = values           # what the table summarises
    out["first_s_max"] = max(out["rank_first_s"])
    for metric in ("pool_resident_mib", "pool_reserved_mib", "pool_slots"):  # the ranks' pools
        values = [r.get(metric) for r in ordered]
        out[metric] = None if None in values else sum(values)
    return out


def _rank_pids(tmp: str) -> list:
    pids = []
    for name in os.listdir(tmp):
        if name.endswith(".pid"):
            with open(os.path.join(tmp, name)) as f:
                pids.append(json.load(f)["pid"])
    return pids


def _read_results(tmp: str, ranks: int) -> dict:
    results = {}
    for r in range(ranks):
        path = os.path.join(tmp, f"rank-{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[r] = json.load(f)
    return results


def _tail(path: str, lines: int = 3) -> str:
    with open(path, errors="replace") as f:
        text = [x for x in f.read().strip().splitlines() if x.strip()]
    return " | ".join(text[-lines:])[-400:] or "(nothing)"


def _leftovers(torchrun: int, rank_pids: list, job_pids: set, names0: set) -> list:
    """What the job left after torchrun exited (bounded wait): live processes of its
    sessions, live job pids, and new /dev/shm names carrying a job pid. Killed by pid."""
    import procs

    deadline = time.monotonic() + CLEAN_WAIT_S
    while True:
        table = procs.processes()
        sessions = {torchrun, *rank_pids}
        alive = sorted(p for p, proc in table.items() if proc.state not in ZOMBIE
                       and (proc.session in sessions or p in job_pids))
        names = procs.names_of(job_pids | {torchrun}, procs.shm_names() - names0)
        if not (alive or names) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    kill_pids(alive)
    return [f"process {p} ({procs.cmdline(p)[:60]})" for p in alive] + [f"/dev/shm/{n}" for n in names]


# ---------------------------------------------------------------------------
# the report

def _flat(raw, cell, arm, metric) -> list:
    return [v for values in raw.series(cell, arm, f"rank_{metric}") for v in values]


def _cell(raw, cell, arm, metric, spec) -> str:
    import common

    values = _flat(raw, cell, arm, metric) if metric in PER_RANK else raw.series(cell, arm, metric)
    s = common.summarize(values)
    errors = raw.errors[cell][arm]
    if s.n == 0:
        return "FAILED" if errors else "–"
    return s.fmt(spec) + (f" ({len(errors)} failed)" if errors else "")


ROWS = [  # metric, heading, format
    ("workers", "worker processes", ".0f"),
    ("processes", "job processes (ranks + workers)", ".0f"),
    ("cgroup_peak_mib", "cgroup peak charge MiB (the job's own memory cgroup)", ".0f"),
    ("cgroup_now_mib", "cgroup charge MiB at the census", ".0f"),
    ("cgroup_anon_mib", "of which anonymous MiB", ".0f"),
    ("cgroup_shmem_mib", "of which shmem/memfd MiB", ".0f"),
    ("cgroup_file_mib", "of which page cache MiB", ".0f"),
    ("pool_slots", "slots, every rank's pool", ".0f"),
    ("pool_reserved_mib", "slots reserved MiB (stats.memory(), summed over ranks)", ".0f"),
    ("pool_resident_mib", "slots resident MiB (stats.memory(), summed over ranks)", ".0f"),
    ("pss_mib", "node PSS MiB (job's processes)", ".0f"),
    ("worker_pss_mib", "of which workers' PSS MiB", ".0f"),
    ("first_s", "first batch s, per rank", ".2f"),
    ("batch_s", "batches/s per rank", ".2f"),
    ("main_cpu_ms", "main-thread CPU ms/batch, per rank", ".2f"),
    ("worker_cpu_ms", "workers' CPU ms per delivered batch", ".1f"),
]


def table(raw, cfg) -> str:
    import common
    import writers

    arms = [a for a in ARMS if a in cfg.arms_list]
    ratios = [(a, b) for a, b in (("node", "pool"), ("share", "pool"), ("pool", "torch"),
                                  ("node", "torch"))
              if a in arms and b in arms]
    out = []
    for cell in raw.cells:
        rows = []
        for metric, heading, spec in ROWS:
            row = [heading] + [_cell(raw, cell, arm, metric, spec) for arm in arms]
            row += [common.ratio_text(raw, cell, a, b, metric) for a, b in ratios]
            rows.append(row)
        heads = ["metric"] + [ARM_LABEL[a] for a in arms] + [f"{a} ÷ {b}" for a, b in ratios]
        failed = [f"{ARM_LABEL[a]} failed {len(raw.errors[cell][a])}×: "
                  + "; ".join(sorted(set(raw.errors[cell][a]))) for a in arms if raw.errors[cell][a]]
        out.append(f"### {cell} local ranks\n\n" + writers.markdown_table(heads, rows)
                   + "".join(f"\n\n{line}" for line in failed))
    out.append("### Targets\n\n" + writers.markdown_table(
        ["ranks", "target", "measured", "verdict"], targets(raw, cfg), "rlll"))
    return "\n\n".join(out)


def _median(raw, cell, arm, metric):
    import common

    s = common.summarize(raw.series(cell, arm, metric))
    return s.median if s.n else None


def _not_measured(raw, cell, *arms) -> str:
    failed = [ARM_LABEL[a] for a in arms if raw.errors[cell].get(a)]
    return "not measured" + (f" ({' and '.join(failed)} failed: see above)" if failed else "")


def targets(raw, cfg) -> list:
    """[ranks, target, measured, verdict] of the issue's targets at each rank count:
    the node arm's three against PoolLoader per rank, the share arm's one."""
    rows = []
    for ranks in raw.cells:
        if "node" in cfg.arms_list:
            rows += _node_targets(raw, cfg, ranks)
        if "share" in cfg.arms_list and "pool" in cfg.arms_list:
            rows.append(_share_target(raw, ranks))
    return rows


def _node_targets(raw, cfg, ranks: int) -> list:
    import common

    rows = []
    bound = cfg.num_workers + ranks + 1
    n = _median(raw, ranks, "node", "processes")
    pool_n = _median(raw, ranks, "pool", "processes") if "pool" in cfg.arms_list else None
    text = f"job processes ≤ num_workers + ranks + 1 = {cfg.num_workers} + {ranks} + 1 = {bound}"
    if n is None:
        rows.append([ranks, text, "–", _not_measured(raw, ranks, "node")])
    else:
        measured = f"{n:.0f}" + (f" (PoolLoader per rank: {pool_n:.0f})" if pool_n is not None else "")
        verdict = "met" if n <= bound else f"missed by {n - bound:.0f}"
        given = node_workers_given(cfg, ranks)
        if given not in (None, cfg.num_workers):
            verdict += f" (the node arm ran node_workers={given}; the target is for the default)"
        rows.append([ranks, text, measured, verdict])
    if "pool" not in cfg.arms_list:
        return rows
    r = common.ratio(raw, ranks, "node", "pool", "pss_mib")
    text = "node PSS ≤ 0.5 × PoolLoader per rank's"
    if not r.n:
        rows.append([ranks, text, "–", _not_measured(raw, ranks, "node", "pool")])
    else:
        rows.append([ranks, text, r.fmt(".2f", "×"),
                     "met" if r.median <= 0.5 else f"missed by {r.median / 0.5:.2f}×"])
    r = common.ratio(raw, ranks, "node", "pool", "batch_s")
    text = "batches/s per rank ≥ 0.9 × PoolLoader per rank's, same total worker count"
    if not r.n:
        rows.append([ranks, text, "–", _not_measured(raw, ranks, "node", "pool")])
        return rows
    node_w = _median(raw, ranks, "node", "workers")
    pool_w = _median(raw, ranks, "pool", "workers")
    verdict = "met" if r.median >= 0.9 else f"missed by {0.9 / r.median:.2f}×"
    if node_w != pool_w:
        verdict = (f"not comparable ({node_w:.0f} worker processes against {pool_w:.0f}: "
                   f"rerun with --node-workers total); at these counts: {verdict}")
    rows.append([ranks, text, r.fmt(".2f", "×"), verdict])
    return rows


def _share_target(raw, ranks: int) -> list:
    """share_batches over every rank: the workers' CPU per delivered batch ≤ 0.3 × what
    PoolLoader per rank spends, both arms drawing the same batches on every rank."""
    import common

    r = common.ratio(raw, ranks, "share", "pool", "worker_cpu_ms")
    text = ("workers' CPU ms per delivered batch ≤ 0.3 × PoolLoader per rank's, "
            "every rank the same batches")
    if not r.n:
        return [ranks, text, "–", _not_measured(raw, ranks, "share", "pool")]
    verdict = "met" if r.median <= 0.3 else f"missed by {r.median / 0.3:.2f}×"
    if ranks != 4:
        verdict += (f" (set for 4 ranks; {ranks} ranks sharing make each batch once, "
                    f"so about 1/{ranks} = {1 / ranks:.2f} is expected)")
    return [ranks, text, r.fmt(".2f", "×"), verdict]


# ---------------------------------------------------------------------------

def node_workers_given(cfg, ranks: int):
    """node_workers= as the node arm passes it at `ranks` ranks (None: not passed)."""
    return ranks * cfg.num_workers if cfg.node_workers == "total" else cfg.node_workers


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--rank-child"]:  # started by torchrun
        rank_child(json.loads(sys.argv[2]))
        return 0
    sys.path.insert(0, os.path.dirname(HERE))
    import common
    import procs
    import workload
    import writers

    p = common.parser(NAME, __doc__, reps=(1, 1), warmup_reps=(0, 0))
    p.add_argument("--ranks", default="2,4", help="local rank counts, comma-separated (default 2,4)")
    p.add_argument("--arms", default=None,
                   help=f"comma-separated, of {', '.join(ARMS)} (default: all; without "
                        f"--same-batches all but {', '.join(SAME_BATCHES_ONLY)})")
    p.add_argument("--num-workers", type=int, default=2, help="each rank's num_workers (default 2)")
    p.add_argument("--node-workers", default=None,
                   help="node_workers= of the node arm: N, or 'total' for ranks × num_workers "
                        "(default: not given, i.e. num_workers)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per rank (20; quick 8)")
    p.add_argument("--warmup-batches", type=int, default=None,
                   help="untimed batches per rank after the first (4; quick 2)")
    p.add_argument("--row", default="per_sample",
                   help="what crosses the boundary, a row of bench/handoff.py (default per_sample: "
                        "RF-DETR's 16 target dicts)")
    p.add_argument("--resolution", type=int, default=workload.RESOLUTION,
                   help=f"image side (default {workload.RESOLUTION})")
    p.add_argument("--seed", type=int, default=0, help="DistributedSampler's seed")
    p.add_argument("--same-batches", action="store_true",
                   help="every rank's sampler gives the same batches (DistributedSampler("
                        "num_replicas=1, rank=0)), for every arm; the share arm needs it")
    p.add_argument("--loader-timeout", type=float, default=120.0,
                   help="the loaders' timeout= in seconds (default 120)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per torchrun job before it is killed and counts as failed")
    cfg = common.parse(p, argv)
    try:
        cfg.ranks_list = [int(x) for x in cfg.ranks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks must be comma-separated integers, got {cfg.ranks!r}")
    if not cfg.ranks_list or min(cfg.ranks_list) < 1:
        p.error(f"--ranks must be positive rank counts, got {cfg.ranks!r}")
    if cfg.arms is None:
        cfg.arms = ",".join(a for a in ARMS if cfg.same_batches or a not in SAME_BATCHES_ONLY)
    cfg.arms_list = [a.strip() for a in cfg.arms.split(",") if a.strip()]
    unknown = sorted(set(cfg.arms_list) - set(ARMS))
    if unknown or not cfg.arms_list:
        p.error(f"--arms {cfg.arms!r}: choose from {', '.join(ARMS)}")
    needs = [a for a in cfg.arms_list if a in SAME_BATCHES_ONLY]
    if needs and not cfg.same_batches:
        p.error(f"--arms {','.join(needs)} needs --same-batches (share_batches= ranks must "
                "draw identical batches; compare it with pool under the same samplers)")
    if cfg.num_workers < 1:
        p.error(f"--num-workers must be >= 1 (the bench compares worker processes), got {cfg.num_workers}")
    if cfg.row not in workload.ROW_LABEL:
        p.error(f"--row {cfg.row!r}: choose from {', '.join(workload.ROW_LABEL)}")
    if cfg.node_workers not in (None, "total"):
        try:
            cfg.node_workers = int(cfg.node_workers)
        except ValueError:
            p.error(f"--node-workers must be a number of processes or 'total', got {cfg.node_workers!r}")
        if cfg.node_workers < 1:
            p.error(f"--node-workers must be >= 1, got {cfg.node_workers}")
    cfg.batches = cfg.batches or (8 if cfg.quick else 20)
    cfg.warmup_batches = cfg.warmup_batches if cfg.warmup_batches is not None else (2 if cfg.quick else 4)
    if cfg.batches < 1 or cfg.warmup_batches < 0:
        p.error(f"--batches must be >= 1 and --warmup-batches >= 0, got {cfg.batches}, "
                f"{cfg.warmup_batches}")

    here = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    load0, t0 = os.getloadavg()[0], time.perf_counter()

    def measure(ranks, arm, rep):
        spec = {"arm": arm, "num_workers": cfg.num_workers, "row": cfg.row,
                "node_workers": node_workers_given(cfg, ranks) if arm == "node" else None,
                "resolution": cfg.resolution, "batches": cfg.batches,
                "warmup_batches": cfg.warmup_batches, "seed": cfg.seed + max(rep, 0),
                "same_batches": cfg.same_batches,
                "loader_timeout": cfg.loader_timeout, "timeout": cfg.timeout}
        return run_job(spec, ranks, cfg.timeout)

    raw = common.interleave(cfg.ranks_list, cfg.arms_list, measure, reps=cfg.reps,
                            warmup_reps=cfg.warmup_reps, label=NAME, stagger=True,
                            show=lambda m: (f"{m['processes']} processes, {m['pss_mib']:.0f} MiB PSS, "
                                            f"{m['batch_s']:.2f} batches/s per rank (median), "
                                            f"workers {m['worker_cpu_ms']:.1f} CPU ms/batch"))
    nw = ("not given (num_workers)" if cfg.node_workers is None else
          "ranks × num_workers" if cfg.node_workers == "total" else str(cfg.node_workers))
    flags = "".join(f" {f}" for f, on in (("--quick", cfg.quick), ("--same-batches", cfg.same_batches))
                    if on)
    sampler = ("DistributedSampler(num_replicas=1, rank=0): every rank the same batches"
               if cfg.same_batches else "DistributedSampler over the ranks")
    head = (f"## One pool per node (bench/node.py{flags})\n\n"
            f"torchrun --standalone, gloo on CPU, one node; each rank a {sampler} "
            f"(shuffle, seed {cfg.seed}) and num_workers={cfg.num_workers} (fork); node arm's "
            f"node_workers: {nw}; batch {workload.BATCH} × {cfg.resolution}², row {cfg.row} "
            f"({workload.ROW_LABEL[cfg.row]}); per rank: first batch, {cfg.warmup_batches} warm-up, "
            f"{cfg.batches} timed batches of next()+del; {cfg.reps} rep(s), each arm its own "
            f"torchrun job; this tree {here or '?'}; {writers.env_line()}; 1-min load average "
            f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; run took "
            f"{time.perf_counter() - t0:.0f} s.\n\n"
            "Per-rank rows: median [min–max] over every rank of every repetition; the others "
            "over repetitions. ÷ columns: per-repetition ratios between arms run side by side "
            "(per-rank metrics: each job's median over its ranks). Job processes: torchrun's "
            "live descendants and the members of its and its ranks' sessions, torchrun "
            "excluded; node PSS: their smaps_rollup Pss summed. Workers' CPU: the CPU time of "
            "the job's processes other than the ranks between two readings taken with full "
            "pipelines (after the first batch, after the timed batches), over every batch "
            f"the ranks delivered between them ({cfg.warmup_batches} + {cfg.batches} per rank). "
            "Process counts and PSS hardly depend on load; times on a shared 2-core machine "
            "do.\n\n")
    metrics = [m for m, _, _ in ROWS] + ["rank_pss_mib", "torchrun_pss_mib", "first_s_max",
                                         "worker_cpu_s"]
    writers.write_outputs(cfg, head + table(raw, cfg),
                          {"raw": raw.as_json(), "summaries": common.summaries(raw, metrics, "pool"
                                                                               if "pool" in cfg.arms_list
                                                                               else None),
                           "targets": targets(raw, cfg), "tree_rev": here})
    if cfg.plot:
        writers.plot_bars(cfg.plot, [f"{r} ranks" for r in raw.cells],
                          {ARM_LABEL[a]: [common.summarize(raw.series(r, a, "pss_mib")) for r in raw.cells]
                           for a in ARMS if a in cfg.arms_list},
                          ylabel="node PSS, MiB (sum over the job's processes)",
                          title=f"one pool per node: num_workers={cfg.num_workers} per rank")
    return 0 if not procs.wait_no_children() else 1


if __name__ == "__main__":
    sys.exit(main())
