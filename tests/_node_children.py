"""One local rank of test_node_pool.py: `python _node_children.py CASE OUT_DIR [ARG]`.

Environment: LOCAL_RANK, LOCAL_WORLD_SIZE and TORCHELASTIC_RUN_ID, as torchrun sets
them; or, under POOLLOADER_TEST_DIST, none of them and an initialised torch.distributed,
as mp.spawn starts ranks (the test sets them; no process group is needed: each rank's DistributedSampler
is given its rank). Ranks meet through files in OUT_DIR (`meet`), bounded. Each rank
writes OUT_DIR/rank<R>.json and exits 0; an exception exits 1 with its traceback.

Cases:
  parity ARG=persistent(0/1)  a map-style dataset with random augmentation in
        __getitem__ (random, torch, numpy) and a worker_init_fn that draws from every
        RNG and changes its copy of the dataset, under DistributedSampler(shuffle=True),
        two epochs: first DataLoader(num_workers=2), then PoolLoader(node_pool=True);
        records whether they are equal, and this rank's children while the node
        pool iterates.
  parity_break ARG=[node_workers[:num_workers]]  as parity with persistent workers,
        under a RandomSampler with a generator of its own, three epochs, the first two
        left early (BREAKS): a logical worker must fetch, before the next epoch, every
        request its DataLoader worker had, and the sampler draw as far. Another
        num_workers than WORKERS: 25 ms an item (Slow), so requests are still out then.
  interrupt  one node process: a KeyboardInterrupt as the third next() hands its
        batch from the reorder buffer to _process_data; at most that batch is lost (as
        with DataLoader), the rest of the epoch must be DataLoader's.
  iterable  an IterableDataset that shards by get_worker_info() and rank.
  auto  node_workers="auto" (POOLLOADER_AUTO_CPUS=2: 1 or 2 processes for 2 ranks × 2
        workers), four epochs: two main-bound (each rank's step 50 ms, samples instant),
        two worker-bound (samples 15 ms, no step); the host builds each epoch's
        iterator first, and no rank builds an epoch's iterator before every rank built
        the one before (else the host, ahead, can move again before rank 1 begins an
        epoch). Records whether every epoch is DataLoader's, the process count and
        node pids of each epoch, the moves, and the host's children at the end.
        ARG "client_first": rank 1 builds the last epoch's iterator before the host
        moves; "stale": after, with the generation it knew before (its refresh skipped);
        "persistent": persistent workers (the pace in OUT/pace, set by rank 0), each
        rank's iterator restarting onto the new processes as its next epoch begins;
        "persistent_break": the same, the third epoch left after 6 of its 12 batches;
        "start_fails": the host's last iterator is built while it and its descendants
        can fork nothing (a pids cgroup capped at their count): the move up fails.
  alone  rank 0 builds a node-pool loader that rank 1 does not (POOLLOADER_NODE_ALONE_S
        set short by the test), 24 batches paced at 60 ms an item: records, after each
        next(), the seconds since before the build, its requests out and its cap, and
        whether the epoch is DataLoader's. ARG "late": rank 1 builds one at the same
        place once rank 0 saw its cap rise (joining its node) and says so in a file,
        which rank 0 waits for there; rank 0 records how many batches it had then.
        "auto": node_workers="auto" (POOLLOADER_AUTO_CPUS=4), two epochs, unpaced, the
        second built after the wait: records the process count of each.
  one_copy  each rank's dataset holds the same 1 MiB array, into which every item
        writes (Table): records whether the epoch is DataLoader's, the inode of this
        rank's start payload and, with every rank's payload loaded, the start payloads
        each node process maps.
  mismatch  rank 1 builds its loader with batch_size 5: records the error.
  dist_alone  (under POOLLOADER_TEST_DIST) rank 1 builds no loader; rank 0 records the
        error its node-pool loader's construction raised, and how long it took.
  resume  three batches, state_dict(), a second node-pool loader resumes from it: the
        epoch must equal DataLoader's.
  rank_killed  rank 1 takes two batches, records its pool's memfd inodes, and
        SIGKILLs itself; rank 0 goes on: its epoch must equal DataLoader's, and the
        node's processes must unmap rank 1's pool.
  host_killed  both take a batch; rank 0 SIGKILLs itself; rank 1 records the
        error its next() raises, how long it took, and whether the node's processes
        are gone.
  worker_killed  both take a batch; rank 1 SIGKILLs node process 0; both record
        the error.

share_batches=[0, 1] on 3 ranks (ranks 0 and 1 one data-parallel rank, with the same
sampler; rank 2 another, not in the group):
  share ARG=persistent(0/1)[node][dist]  two epochs of DataLoader, then of
        PoolLoader(share_batches) (with "node": and node_pool=True; "dist": the group a
        torch.distributed.new_group);
        records whether they are equal, the memfd inode behind each batch, this rank's
        children, and __getitem__ calls per phase (files calls.<phase>.<pid> in OUT).
  share_mismatch [loader]  rank 1's sampler has another seed (or, with "loader", its
        batch_size differs): records the error, and where it came.
  share_follower_killed  rank 1 takes two batches and SIGKILLs itself; rank 0 goes on.
  share_leader_killed  both take a batch; rank 0 SIGKILLs itself; rank 1 records the error.
  share_two_groups  groups [0, 1] and [0, 2], one sampler: rank 0 leads both, with a
        loader each; records whether each loader's epoch is DataLoader's, and the roles.
  share_restart  both ranks leave an epoch after one batch for a new iterator, and drop
        the old one after the new one began: the new epoch must be DataLoader's.
  share_cuda ARG=pin|device  ranks 0 and 1 only, each with the CPU stand-in of the CUDA
        runtime (tests/cuda_standin.py) and pin_memory=True (or device="cuda"), 30
        batches an epoch, persistent workers. Epoch 0 runs each rank's copies after each
        batch; in epoch 1 every copy stays queued (it reads the slot only when it runs,
        as a DMA does) until the epoch ended. Records whether the copies equal its
        DataLoader's batches, the registrations, the follower's held-back releases, and
        after teardown the unregistrations, violations and children left.
  share_nodes  4 ranks on 2 simulated nodes (GROUP_RANK 0 and 1), all in one group with
        the same sampler: records whether each got its DataLoader's batches, and its role.
"""
from __future__ import annotations

import gc
import json
import os
import random
import signal
import sys
import time
import traceback
import warnings

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    get_worker_info,
)

from poolloader import PoolLoader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import proc  # noqa: E402  (tests/proc.py: the process table)

# as conftest.py sets it for the suite (the process-tree checks of the parity cases then
# do not hold: forkserver's workers are its children, not the rank's; the data checks do)
if os.environ.get("POOLLOADER_TEST_START_METHOD"):
    torch.multiprocessing.set_start_method(os.environ["POOLLOADER_TEST_START_METHOD"], force=True)
CASE, OUT = sys.argv[1], sys.argv[2]
ARG = sys.argv[3] if len(sys.argv) > 3 else ""
# global ranks (one node: local). Under POOLLOADER_TEST_DIST (a FileStore path) a rank
# is started as mp.spawn starts one: no torchrun variable, not even RANK; it initialises
# torch.distributed (gloo) itself, and the loaders find their node through it.
DIST = os.environ.get("POOLLOADER_TEST_DIST")
RANK = int(os.environ["POOLLOADER_TEST_RANK" if DIST else "RANK"])
WORLD = int(os.environ["POOLLOADER_TEST_WORLD" if DIST else "WORLD_SIZE"])
N_SAMPLES, BATCH, WORKERS = 48, 4, 2
# parity_break's epochs: left after 1 batch (the requests held past a rank's share still
# to fetch), after all but the last (the sampler drawn to its end), then whole
BREAKS = (1, N_SAMPLES // BATCH - 1, None)
FAULT_SAMPLES = 800  # 100 batches a rank: a death always comes before the epoch ends
MEET_S = 60.0


def meet(name: str, ranks=None) -> None:
    """Wait (bounded) until every rank (of `ranks`, default all) reached `name`."""
    open(os.path.join(OUT, f"{name}.{RANK}"), "w").close()
    deadline = time.monotonic() + MEET_S
    while not all(os.path.exists(os.path.join(OUT, f"{name}.{r}"))
                  for r in (range(WORLD) if ranks is None else ranks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: the other ranks did not reach {name!r}")
        time.sleep(0.01)


def note(name: str, value) -> None:
    with open(os.path.join(OUT, f"{name}.{RANK}.json"), "w") as f:
        json.dump(value, f)


def read(name: str, rank: int, timeout: float = MEET_S):
    path = os.path.join(OUT, f"{name}.{rank}.json")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: no {name!r} from rank {rank}")
        time.sleep(0.01)
    time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


class Augmented(Dataset):
    """Item i: its index, draws from random, numpy and torch, and the worker's offset
    (set by init_fn in its own copy)."""

    def __init__(self, n=N_SAMPLES):
        self.offset = 0
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return (torch.tensor([i, info.id, self.offset, random.randint(0, 10**6),
                              int(np.random.randint(0, 10**6))]),
                torch.rand(3, 4))


class Paced(Augmented):
    """Augmented whose items take `pace` seconds (set in main between epochs: each
    epoch's workers load the dataset as it is then)."""

    pace = 0.0

    def __getitem__(self, i):
        if self.pace:
            time.sleep(self.pace)
        return super().__getitem__(i)


class FilePaced(Augmented):
    """Augmented whose items take the seconds written in OUT/pace, read at each item:
    persistent workers keep their copy of the dataset, so the pace changes there."""

    def __getitem__(self, i):
        try:
            with open(os.path.join(OUT, "pace")) as f:
                pace = float(f.read() or 0)
        except FileNotFoundError:
            pace = 0.0
        if pace:
            time.sleep(pace)
        return super().__getitem__(i)


class Slow(Augmented):
    """Augmented, 25 ms an item: an epoch left early still has requests out."""

    def __getitem__(self, i):
        time.sleep(0.025)
        return super().__getitem__(i)


class Table(Augmented):
    """Augmented with a 1 MiB array that every rank builds alike: each item adds 1 to
    a row of its worker's copy and returns the row's sum after, so a write another
    worker made into the same copy would show in the batches."""

    def __init__(self, n=N_SAMPLES):
        super().__init__(n)
        self.table = np.arange(1 << 17, dtype=np.float64).reshape(256, 512)

    def __getitem__(self, i):
        row = self.table[i % 4]
        row += 1
        return super().__getitem__(i) + (torch.tensor(row.sum()),)


def init_fn(worker_id):
    info = get_worker_info()
    info.dataset.offset = random.randint(0, 1000) + int(np.random.randint(0, 1000)) \
        + int(torch.randint(0, 1000, ()))
    random.seed(random.randint(0, 10**6) + worker_id)


class Shards(IterableDataset):
    """Each (rank, worker) streams its own share of the items, with a random draw; the
    rank read where a dataset reads it, in the worker (a DataLoader worker inherits
    its rank's environment)."""

    def __iter__(self):
        info = get_worker_info()
        rank = int(os.environ["RANK"])
        for i in range(rank * 100 + info.id, rank * 100 + 30, info.num_workers):
            yield torch.tensor([i, info.id, random.randint(0, 10**6)])


_node_builds = [0]  # node-pool loaders this rank built (host_first)


def host_first(build):
    """build(), a node-pool loader, by local rank 0 before the other local ranks: the
    first rank to build one at a place hosts it, and the cases that name the host (its
    children, its death) want it to be local rank 0."""
    k = _node_builds[0]
    _node_builds[0] += 1
    flag = os.path.join(OUT, f"hosted.{os.environ.get('GROUP_RANK', '0')}.{k}")
    if DIST:  # every rank finds the node through the store first, together
        from poolloader.main import rendezvous
        rendezvous.local_group()
    first = int(os.environ.get("LOCAL_RANK", RANK)) == 0
    deadline = time.monotonic() + MEET_S
    while not first and not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: local rank 0 did not build node loader {k}")
        time.sleep(0.01)
    try:
        return build()  # one line for every rank: loaders meet where they are built
    finally:
        if first:
            open(flag, "w").close()


def loader(cls, persistent=False, batch_size=BATCH, n=N_SAMPLES, data=Augmented, **kw):
    dataset = data(n)
    sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=RANK, shuffle=True, seed=5)

    def build():
        return cls(dataset, batch_size=batch_size, sampler=sampler, num_workers=WORKERS,
                   worker_init_fn=init_fn, persistent_workers=persistent,
                   generator=torch.Generator().manual_seed(11 + RANK), **kw)
    return (host_first(build) if kw.get("node_pool") else build()), sampler


def epochs(pair, n=2, during=None):
    it_loader, sampler = pair
    out = []
    for epoch in range(n):
        sampler.set_epoch(epoch)
        batches = []
        for k, batch in enumerate(it_loader):
            batches.append([t.clone() for t in batch])
            if during is not None and epoch == 0 and k == 0:
                during()
        out.append(batches)
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(len(p) == len(q) and all(torch.equal(s, t) for s, t in zip(p, q))
                                 for p, q in zip(x, y))
        for x, y in zip(a, b))


def same_state(a, b) -> bool:
    """Two state_dict()s hold the same values (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class Counted(Augmented):
    """Augmented, and each __getitem__ appends a byte to OUT/calls.<phase>.<pid>."""

    def __init__(self, phase, n=N_SAMPLES):
        super().__init__(n)
        self.phase = phase

    def __getitem__(self, i):
        with open(os.path.join(OUT, f"calls.{self.phase}.{os.getpid()}"), "ab") as f:
            f.write(b"x")
        # and a tensor too big for the small block, so it views the slot itself
        return (*super().__getitem__(i), torch.rand(128, 128))


SHARE_GROUP = [0, 1]


class CountedWithState(Counted):
    """Counted, with a state_dict(): a worker's resume records then carry replay lists
    between snapshots (PoolLoader(snapshot_every_n_steps=))."""

    def state_dict(self):
        return {"n": len(self)}

    def load_state_dict(self, state):
        assert state == {"n": len(self)}


def shared_loader(cls, phase, persistent=False, n=N_SAMPLES, seed=5, batch_size=BATCH,
                  dataset_cls=Counted, **kw):
    """Ranks 0 and 1 are data-parallel rank 0 of 2 (the same sampler and generator), rank
    2 is data-parallel rank 1."""
    dp_rank = 0 if RANK in SHARE_GROUP else 1
    dataset = dataset_cls(phase, n)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=dp_rank, shuffle=True, seed=seed)

    def build():
        return cls(dataset, batch_size=batch_size, sampler=sampler, num_workers=WORKERS,
                   worker_init_fn=init_fn, persistent_workers=persistent,
                   generator=torch.Generator().manual_seed(11 + dp_rank), **kw)
    return (host_first(build) if kw.get("node_pool") else build()), sampler


def backing_inode(tensor: torch.Tensor) -> int | None:
    """The inode of the memfd segment whose mapping holds `tensor`'s data (None: none)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end and len(fields) > 5 and "memfd:" in fields[5]:
                return int(fields[4])
    return None


def children() -> list:
    """This rank's live children, and those of its zygotes (poolloader.worker.zygote:
    under spawn/forkserver they fork the node's processes) as ("zygote", pid); not the
    service processes (the zygotes, multiprocessing's resource tracker and forkserver),
    which a start method other than fork starts once per process, as conftest counts."""
    from multiprocessing import forkserver, resource_tracker

    from poolloader.worker import zygote

    service = {*zygote.pids(), getattr(resource_tracker._resource_tracker, "_pid", None),
               getattr(forkserver._forkserver, "_forkserver_pid", None)}
    forked = [["zygote", pid] for z in zygote.pids() for pid in proc.live_children(parent=z)]
    return sorted(set(proc.live_children(parent=os.getpid())) - service) + forked


PIDS_CGROUP = "/sys/fs/cgroup/pids"  # cgroup v1's pids controller (the test skips without)


def pids_capped() -> str:
    """This process and its descendants moved into a new pids cgroup whose limit is
    what they are now: no fork (nor thread) among them succeeds until uncap()."""
    path = os.path.join(PIDS_CGROUP, f"pltest-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(path)
    for pid in proc.tree(proc.process_table()):
        try:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError:  # exited meanwhile
            pass
    with open(os.path.join(path, "pids.current")) as f:
        current = f.read().strip()
    with open(os.path.join(path, "pids.max"), "w") as f:
        f.write(current)
    return path


def uncap(path: str) -> None:
    """pids_capped()'s processes back in the root pids cgroup, the cgroup removed."""
    with open(os.path.join(path, "pids.max"), "w") as f:
        f.write("max")
    with open(os.path.join(path, "cgroup.procs")) as f:
        pids = f.read().split()
    for pid in pids:
        try:
            with open(os.path.join(PIDS_CGROUP, "cgroup.procs"), "w") as f:
                f.write(pid)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while True:
        try:
            os.rmdir(path)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> dict:
    if CASE == "parity":
        # ARG "<persistent>[:<node_workers>]"
        persistent, _, processes = ARG.partition(":")
        persistent = persistent == "1"
        expected = epochs(loader(DataLoader, persistent))
        seen = {}
        pool = loader(PoolLoader, persistent, node_pool=True,
                      node_workers=int(processes) if processes else None)
        got = epochs(pool, during=lambda: seen.update(children=children()))
        kept = pool[0]._iterator  # persistent workers: the epochs' one iterator
        result = {"equal": same(expected, got), "batches": len(got[0]),
                  "children": seen["children"], "node_pids": pool[0]._node.pids,
                  "host": pool[0]._node.host_pid,
                  "in_flight": kept and kept._max_in_flight,
                  "slots": kept and kept._pool.num_slots,
                  "detaches": pool[0].stats.detaches}
        del kept
        meet("done")
        return result
    if CASE == "parity_break":
        # ARG "[<node_workers>[:<num_workers>]]" (defaults num_workers and WORKERS)
        processes, _, workers = ARG.partition(":")
        workers = int(workers) if workers else WORKERS

        def make(cls, **kw):
            dataset = Slow() if workers != WORKERS else Augmented()
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(7 + RANK))
            return cls(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers,
                       worker_init_fn=init_fn, persistent_workers=True,
                       generator=torch.Generator().manual_seed(11 + RANK), **kw)

        def run(it_loader):
            out = []
            for stop in BREAKS:
                batches = []
                for k, batch in enumerate(it_loader):
                    if k == stop:
                        if workers != WORKERS:
                            time.sleep(0.5)  # every request still out is made, unread
                        break
                    batches.append([t.clone() for t in batch])
                out.append(batches)
            return out
        expected = run(make(DataLoader))
        pool = make(PoolLoader, node_pool=True, node_workers=int(processes) if processes else None)
        got = run(pool)
        kept = pool._iterator
        result = {"equal": same(expected, got), "lengths": [len(b) for b in got],
                  "in_flight": kept._max_in_flight, "slots": kept._pool.num_slots,
                  "detaches": pool.stats.detaches}
        del kept
        meet("done")
        return result
    if CASE == "interrupt":
        # KeyboardInterrupt as the third next() hands its batch from the reorder buffer to
        # _process_data (one request out a rank: node_workers=1): at most that batch is
        # lost, as with DataLoader, and the epoch goes on with the next one
        from poolloader.main.iterator import PoolLoaderIter
        expected = epochs(loader(DataLoader), n=1)[0]
        it_loader, sampler = loader(PoolLoader, node_pool=True, node_workers=1)
        sampler.set_epoch(0)
        it = iter(it_loader)
        got = [[t.clone() for t in next(it)] for _ in range(2)]
        code = PoolLoaderIter._process_data.__code__
        fired = []

        def entered(frame, event, _arg):
            if event == "call" and frame.f_code is code and not fired:
                fired.append(True)
                raise KeyboardInterrupt  # where a signal handler runs as it is entered
            return None
        sys.settrace(entered)
        try:
            next(it)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        got += [[t.clone() for t in b] for b in it]
        meet("done")
        return {"interrupted": interrupted, "cap": it._cap,
                "equal": same([expected], [got]) or same([expected[:2] + expected[3:]], [got])}
    if CASE == "iterable":
        def seeded():
            return torch.Generator().manual_seed(3 + RANK)
        expected = [[t.clone() for t in b] for b in DataLoader(
            Shards(), batch_size=3, num_workers=WORKERS, generator=seeded())]
        pool = PoolLoader(Shards(), batch_size=3, num_workers=WORKERS, generator=seeded(),
                          node_pool=True, node_workers=int(ARG) if ARG else None)
        got = [[t.clone() for t in b] for b in pool]
        meet("done")  # the host's loader lives until every rank is done, as in training
        return {"equal": same([expected], [got]), "batches": len(got)}
    if CASE == "auto":
        phases = [(0.0, 0.05)] * 2 + [(0.015, 0.0)] * 2  # (item s, step s) per epoch

        persistent = ARG.startswith("persistent")
        # "persistent_break": the first worker-bound epoch is left after 6 batches of 12,
        # so the move after it restarts from a state with requests still out
        leave = {2: 6} if ARG == "persistent_break" else {}

        def set_pace(pace):
            path = os.path.join(OUT, "pace")
            with open(path + ".new", "w") as f:
                f.write(str(pace))
            os.replace(path + ".new", path)

        def run(pool: bool):
            dataset = FilePaced(96) if persistent else Paced(96)
            sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=RANK, shuffle=True,
                                         seed=5)

            def build():
                return (PoolLoader if pool else DataLoader)(
                    dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                    worker_init_fn=init_fn, generator=torch.Generator().manual_seed(11 + RANK),
                    persistent_workers=persistent,
                    **({"node_pool": True, "node_workers": "auto"} if pool else {}))
            it_loader = host_first(build) if pool else build()
            out, counts, pids = [], [], []
            for epoch, (pace, step) in enumerate(phases):
                # the pace moves the processes only: DataLoader's reference run goes
                # unpaced (the same batches, sooner)
                if not pool:
                    pace, step = 0.0, 0.0
                dataset.pace = pace
                if persistent and RANK == 0:
                    set_pace(pace)
                sampler.set_epoch(epoch)
                # the last epoch (after the move up): "client_first": rank 1 attaches
                # before the host moves, so the replaced process serves it that epoch;
                # "stale": rank 1 attaches after, naming the generation it last knew (as
                # when the host moves between its refresh and its attach)
                first = 1 if ARG == "client_first" and epoch == len(phases) - 1 else 0
                node = it_loader._node if pool else None
                if node is not None and RANK == 1 and ARG == "stale" \
                        and epoch == len(phases) - 1:
                    node.refresh = lambda node=node: len(node.pids)
                if pool and epoch:  # no rank runs ahead: every rank began the epoch before
                    for r in range(WORLD):
                        read(f"began{epoch - 1}", r)
                if pool and RANK != first:
                    read(f"started{epoch}", first)  # that rank built its iterator first
                # "start_fails": the host's move up cannot fork (a pids cgroup at its count)
                capped = (pids_capped() if pool and RANK == 0 and ARG == "start_fails"
                          and epoch == len(phases) - 1 else None)
                try:
                    it = iter(it_loader)
                finally:
                    if capped is not None:
                        uncap(capped)
                if pool and RANK == first:
                    note(f"started{epoch}", True)
                if pool:
                    note(f"began{epoch}", True)
                batches = []
                for batch in it:
                    batches.append([t.clone() for t in batch])
                    time.sleep(step)
                    if len(batches) == leave.get(epoch):
                        break
                del it
                out.append(batches)
                if pool:
                    counts.append(it_loader.stats.processes)
                    pids.append(list(it_loader._node.pids))
            return it_loader, out, counts, pids
        _, expected, _, _ = run(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool, got, counts, pids = run(True)
        meet("epochs")  # every rank's last iterator ended: the retired processes exit

        def workers():  # the host's node processes (forked by its zygote, if it has one)
            return sorted(c[1] if isinstance(c, list) else c for c in children())
        deadline = time.monotonic() + 10
        while RANK == 0 and workers() != sorted(pids[-1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        result = {"equal": same(expected, got), "counts": counts, "pids": pids,
                  "moves": [str(m) for m in pool.stats.auto_moves],
                  "children": workers() if RANK == 0 else None,
                  "warnings": [str(w.message) for w in caught]}
        meet("done")
        return result
    if CASE == "mismatch":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept, _ = loader(PoolLoader, batch_size=5 if RANK == 1 else BATCH, node_pool=True)
        got, seen = [], []
        for b in kept:
            seen = seen or children()  # while its workers run
            got.append([t.clone() for t in b])
        expected = [[t.clone() for t in b] for b in loader(
            DataLoader, batch_size=5 if RANK == 1 else BATCH)[0]]
        meet("done")  # rank 0's loader lives until then: it hosts while it lives
        return {"warnings": [str(w.message) for w in caught], "joined": kept._node is not None,
                "equal": same([expected], [got]), "children": len(seen)}
    if CASE == "places":
        # ARG "before" / "after": rank 0 builds an evaluation loader before (or after) the
        # train loader that every rank builds, and drops it; rank 1 builds one that only
        # it builds, at another place, after a pause. Records drop times and roles.
        times: dict = {}

        def evaluate():
            start = time.monotonic()
            ev = PoolLoader(Augmented(12), batch_size=4, num_workers=WORKERS, node_pool=True,
                            generator=torch.Generator().manual_seed(3))
            got = [[t.clone() for t in b] for b in ev]
            role = type(ev._node).__name__
            start_drop = time.monotonic()
            del ev
            gc.collect()
            times.setdefault("drops", []).append(time.monotonic() - start_drop)
            times.setdefault("roles", []).append(role)
            times.setdefault("builds", []).append(start_drop - start)
            plain = [[t.clone() for t in b] for b in DataLoader(
                Augmented(12), batch_size=4, num_workers=WORKERS,
                generator=torch.Generator().manual_seed(3))]
            times.setdefault("eval_equal", []).append(same([plain], [got]))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if RANK == 0 and ARG == "before":
                evaluate()
            if RANK == 1:
                time.sleep(2.0)  # the ranks reach the train loader seconds apart
            expected = epochs(loader(DataLoader))
            pool = loader(PoolLoader, node_pool=True)  # local rank 0 first (host_first)
            got = epochs(pool)
            if RANK == 0 and ARG == "after":
                evaluate()
            if RANK == 1:
                time.sleep(1.0)
                evaluate()  # only this rank builds it, at this place
        result = {"equal": same(expected, got), "role": type(pool[0]._node).__name__,
                  "host": pool[0]._node.host_pid, **times,
                  "warnings": [str(w.message) for w in caught if "PoolLoader" in str(w.message)]}
        meet("done")
        return result
    if CASE == "alone":
        def make(cls, **kw):
            dataset = FilePaced(96)
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(7 + RANK))
            return cls(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                       worker_init_fn=init_fn, generator=torch.Generator().manual_seed(11 + RANK),
                       **kw)

        if RANK == 1 and ARG != "late":  # builds nothing
            meet("done")
            return {}
        if ARG == "auto":  # two epochs, the second built after the wait
            plain = make(DataLoader)
            expected = [[[t.clone() for t in b] for b in plain] for _ in range(2)]
            pool = make(PoolLoader, node_pool=True, node_workers="auto")
            got, counts = [], []
            for epoch in range(2):
                if epoch:
                    time.sleep(float(os.environ["POOLLOADER_NODE_ALONE_S"]))
                it = iter(pool)
                counts.append(len(pool._node.pids))
                got.append([[t.clone() for t in b] for b in it])
                del it
            result = {"equal": same(expected, got), "counts": counts,
                      "moves": [str(m) for m in pool.stats.auto_moves]}
            meet("done")
            return result
        expected = [[t.clone() for t in b] for b in make(DataLoader)]
        if ARG == "late":
            meet("expected")  # both DataLoader epochs unpaced
        if RANK == 0:
            with open(os.path.join(OUT, "pace"), "w") as f:
                f.write("0.06")
        else:
            read("past", 0)  # rank 0's cap rose: it was alone long enough
        started = time.monotonic()
        pool = make(PoolLoader, node_pool=True)  # one line: both ranks build it here
        role = type(pool._node).__name__
        if RANK == 1:
            note("joined", True)
        it = iter(pool)
        built = time.monotonic() - started, it._max_in_flight
        got, seen, joined = [], [], None
        for batch in it:
            got.append([t.clone() for t in batch])
            seen.append((time.monotonic() - started, it._slots_out(), it._cap))
            if RANK == 0 and ARG == "late" and joined is None and it._cap > 2:
                note("past", True)
                read("joined", 1)  # rank 1 joined (the epoch waits for it)
                joined = len(seen)  # observations from here on come after rank 1 joined
        del it
        result = {"equal": same([expected], [got]), "role": role, "built": built,
                  "seen": seen, "joined": joined}
        meet("done")
        return result
    if CASE == "dist_alone":  # rank 1 builds no loader at all
        error, took = None, None
        if RANK == 0:
            start = time.monotonic()
            try:
                loader(PoolLoader, node_pool=True)
            except RuntimeError as e:
                error, took = str(e), time.monotonic() - start
        meet("done")
        return {"error": error, "took": took}
    if CASE == "resume":
        # ARG: node_workers (default num_workers)
        more = dict(node_workers=int(ARG)) if ARG else {}
        expected = epochs(loader(DataLoader), n=1)[0]
        first, _ = loader(PoolLoader, node_pool=True, **more)
        it = iter(first)
        head = [[t.clone() for t in next(it)] for _ in range(3)]
        state = first.state_dict()
        again, _ = loader(PoolLoader, node_pool=True, **more)  # every rank's next one
        again.load_state_dict(state)
        rest = [[t.clone() for t in b] for b in again]
        meet("done")
        del it
        return {"equal": same([expected], [head + rest]), "batches": len(head + rest)}
    if CASE == "one_copy":
        expected = epochs(loader(DataLoader, data=Table), n=1)
        pool, sampler = loader(PoolLoader, data=Table, node_pool=True)
        sampler.set_epoch(0)
        it = iter(pool)
        start = it._shared_start.ticket[2] if it._shared_start is not None else None
        # two batches: one from each logical worker, so both node processes loaded
        # this rank's payload (each hosts one logical worker of each rank)
        batches = [[t.clone() for t in next(it)] for _ in range(2)]
        meet("loaded")
        mapped = {pid: sorted(start_inodes(pid)) for pid in pool._node.pids}
        meet("read")
        batches += [[t.clone() for t in b] for b in it]
        return {"equal": same(expected, [batches]), "start": start, "mapped": mapped}
    if CASE == "rank_killed":
        expected = epochs(loader(DataLoader, n=FAULT_SAMPLES), n=1)
        pool, sampler = loader(PoolLoader, n=FAULT_SAMPLES, node_pool=True)
        it = iter(pool)
        first = [[t.clone() for t in next(it)]]
        meet("started")
        if RANK == 1:
            next(it)
            note("inodes", pool_inodes())
            os.kill(os.getpid(), signal.SIGKILL)
        victim = read("inodes", 1)
        gone = proc.wait_gone([read_pid(1)], 10.0)
        rest = [[t.clone() for t in b] for b in it]
        node_pids = pool._node.pids
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            mapped = {inode for pid in node_pids for inode in proc.memfd_segments(pid)}
            if not mapped & set(victim):
                break
            time.sleep(0.05)
        return {"equal": same(expected, [first + rest]), "rank1_gone": gone,
                "still_mapped": sorted(mapped & set(victim)), "victim_inodes": len(victim)}
    if CASE == "host_killed":
        pool, sampler = loader(PoolLoader, n=FAULT_SAMPLES, node_pool=True)
        it = iter(pool)
        next(it)
        meet("started")
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        proc.wait_gone([read_pid(0)], 10.0)
        error, took = drain(it)
        pids = pool._node.pids
        return {"error": error, "took": took, "node_pids": pids,
                "node_gone": proc.wait_gone(pids, 10.0)}
    if CASE == "worker_killed":
        pool, sampler = loader(PoolLoader, n=FAULT_SAMPLES, node_pool=True)
        it = iter(pool)
        next(it)
        meet("started")
        victim = pool._node.pids[0]
        if RANK == 1:
            os.kill(victim, signal.SIGKILL)
        proc.wait_gone([victim], 10.0)
        error, took = drain(it)
        result = {"error": error, "took": took, "victim": victim}
        meet("done")
        return result
    if CASE == "share":
        persistent, node_pool = ARG.startswith("1"), "node" in ARG
        torch.manual_seed(0)
        expected = epochs(shared_loader(DataLoader, "torch", persistent))
        torch.manual_seed(0)
        group = torch.distributed.new_group(SHARE_GROUP) if DIST else SHARE_GROUP
        pool, sampler = shared_loader(PoolLoader, "pool", persistent, share_batches=group,
                                      node_pool=node_pool)
        seen: dict = {"inodes": []}

        def look(batch):
            seen["inodes"].append(backing_inode(batch[2]))
            seen.setdefault("children", children())
        got = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            batches = []
            for batch in pool:
                if epoch == 0:
                    look(batch)
                batches.append([t.clone() for t in batch])
            got.append(batches)
        # a loader nobody keeps (collected while its iterator runs) shares all the same
        torch.manual_seed(0)
        again = [[t.clone() for t in b] for b in shared_loader(
            PoolLoader, "again", share_batches=SHARE_GROUP, node_pool=node_pool)[0]]
        result = {"equal": same(expected, got), "batches": len(got[0]),
                  "again_equal": same(expected[:1], [again]),
                  "inodes": seen["inodes"], "children": seen["children"],
                  "role": getattr(pool._share, "role", None)}
        meet("done")
        return result
    if CASE == "share_partial":
        return share_partial()
    if CASE == "share_mismatch":
        differs = RANK == 1
        # ARG "loader": rank 1's batch_size differs; "persistent": its persistent_workers
        # (the batches' indices agree, not their augmentation); else its sampler's seed
        try:
            pool, _ = shared_loader(PoolLoader, "pool", seed=6 if differs and not ARG else 5,
                                    batch_size=5 if differs and ARG == "loader" else BATCH,
                                    persistent=differs and ARG == "persistent",
                                    share_batches=SHARE_GROUP)
            error, _took = drain(iter(pool))
        except ValueError as e:
            error = f"constructor: {e}"
        meet("done")
        return {"error": error}
    if CASE == "share_follower_killed":
        expected = epochs(shared_loader(DataLoader, "torch", n=FAULT_SAMPLES), n=1)
        pool, _ = shared_loader(PoolLoader, "pool", n=FAULT_SAMPLES, share_batches=SHARE_GROUP)
        it = iter(pool)
        first = [[t.clone() for t in next(it)]]
        meet("started")
        if RANK == 1:
            next(it)
            os.kill(os.getpid(), signal.SIGKILL)
        if RANK == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rest = [[t.clone() for t in b] for b in it]
            result = {"equal": same(expected, [first + rest]),
                      "rank1_gone": proc.wait_gone([read_pid(1)], 10.0),
                      "warnings": [str(w.message) for w in caught],
                      "detaches": pool.stats.detaches}
        else:
            result = {"equal": None}
        meet("done", ranks=(0, 2))
        return result
    if CASE == "share_leader_killed":
        pool, _ = shared_loader(PoolLoader, "pool", n=FAULT_SAMPLES, share_batches=SHARE_GROUP)
        it = iter(pool)
        next(it)
        meet("started")
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if RANK == 1:
            proc.wait_gone([read_pid(0)], 10.0)
            error, took = drain(it)
            return {"error": error, "took": took}
        return {}
    if CASE == "share_restart":
        # an epoch left after one batch for a new iterator, the old one dropped after
        # the new one began: the old one's teardown must not end the new epoch
        def restarted(cls, **kw):
            made, _ = shared_loader(cls, "restart", **kw)
            first = iter(made)
            next(first)
            second = iter(made)
            del first
            gc.collect()
            return [[t.clone() for t in b] for b in second]
        expected = restarted(DataLoader)
        got = restarted(PoolLoader, share_batches=SHARE_GROUP)
        meet("done")
        return {"equal": same([expected], [got]), "batches": len(got)}
    if CASE == "share_interrupt":
        # the follower is interrupted (KeyboardInterrupt from a signal handler) while it
        # waits for batch 1, which the leader delivers only after that; next() again
        # waits for the same batch, and the epoch is DataLoader's
        expected = epochs(shared_loader(DataLoader, "torch"), n=1)[0]
        made, sampler = shared_loader(PoolLoader, "pool", share_batches=SHARE_GROUP)
        it = iter(made)
        got = [[t.clone() for t in next(it)]]
        interrupted = False
        if RANK == 1:
            def interrupt(_signum, _frame):
                raise KeyboardInterrupt
            previous = signal.signal(signal.SIGALRM, interrupt)
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            try:
                got.append([t.clone() for t in next(it)])
            except KeyboardInterrupt:
                interrupted = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            note("interrupted", interrupted)
        else:
            read("interrupted", 1)  # batch 1 is published only once rank 1 was interrupted
        got += [[t.clone() for t in b] for b in it]
        meet("done")
        return {"equal": same([expected], [got]), "interrupted": interrupted}
    if CASE == "share_resume":
        # two batches, state_dict() on both ranks, a new loader each from its state:
        # the rest of the epoch and the next equal DataLoader's uninterrupted run, and
        # the follower's state is its leader's. "2": persistent workers, epoch 0 left
        # after two batches (its undelivered batches move the workers' state), the
        # states taken two batches into epoch 1, with device= (a batch staged ahead)
        # and a dataset state_dict() (records with replays between snapshots)
        persistent, left = ARG in ("1", "2"), ARG == "2"
        more = dict(dataset_cls=CountedWithState) if left else {}
        pool_more = dict(more, device="cpu", snapshot_every_n_steps=50) if left else {}
        torch.manual_seed(0)  # the same global RNGs on both ranks, whose states it keeps
        random.seed(0)
        np.random.seed(0)

        def run(made, sampler, save=None):
            out = []
            for epoch in range(2):
                sampler.set_epoch(epoch)
                batches = []
                if left and epoch == 1:
                    iter(made)  # an epoch begun and left before its first batch
                for batch in made:
                    batches.append([t.clone() for t in batch])
                    if len(batches) == 2 and (left and epoch == 0 or save and epoch == left):
                        break
                out.append(batches)
                if save and epoch == left:
                    return out
            return out

        expected = run(*shared_loader(DataLoader, "torch", persistent, **more))
        made, sampler = shared_loader(PoolLoader, "pool", persistent, share_batches=SHARE_GROUP,
                                      **pool_more)
        got = run(made, sampler, save=True)
        state = made.state_dict()
        torch.save(state, os.path.join(OUT, f"state.{RANK}.pt"))
        meet("saved")
        theirs = torch.load(os.path.join(OUT, f"state.{1 - RANK}.pt"), weights_only=True)
        role = made._share.role
        del made
        gc.collect()
        again, sampler = shared_loader(PoolLoader, "pool", persistent, share_batches=SHARE_GROUP,
                                       **pool_more)
        again.load_state_dict(state)
        for epoch in range(left, 2):
            sampler.set_epoch(epoch)
            rest = [[t.clone() for t in b] for b in again]
            if epoch == left:
                got[-1] += rest
            else:
                got.append(rest)
        meet("done")
        return {"equal": same(expected, got), "role": role,
                "same_state": same_state(state, theirs), "batches": [len(e) for e in got]}
    if CASE == "share_two_groups":
        # groups [0, 1] and [0, 2], both led by rank 0: each meets its own followers
        def one(cls, **kw):
            dataset = Augmented()
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
            return cls(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                       worker_init_fn=init_fn, generator=torch.Generator().manual_seed(11), **kw)
        expected = [[t.clone() for t in b] for b in one(DataLoader)]
        made = [one(PoolLoader, share_batches=g)
                for g in {0: [[0, 1], [0, 2]], 1: [[0, 1]], 2: [[0, 2]]}[RANK]]
        got = [[[t.clone() for t in b] for b in m] for m in made]
        meet("done")
        return {"equal": [same([expected], [g]) for g in got],
                "roles": [getattr(m._share, "role", None) for m in made]}
    if CASE == "share_cuda":
        return share_cuda(ARG == "device")
    if CASE == "share_nodes":
        def one(cls, phase, **kw):
            dataset = Counted(phase)
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
            made = cls(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                       generator=torch.Generator().manual_seed(11), **kw)
            return [[t.clone() for t in b] for b in made], getattr(made, "_share", None)
        expected, _ = one(DataLoader, "torch")
        got, side = one(PoolLoader, "pool", share_batches=list(range(WORLD)))
        meet("done")
        return {"equal": same([expected], [got]), "role": getattr(side, "role", None)}
    if CASE == "share_fds":  # 1100 descriptors open in each rank before its loaders
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        try:
            expected = epochs(shared_loader(DataLoader, "torch"), n=1)
            pool, sampler = shared_loader(PoolLoader, "pool", share_batches=SHARE_GROUP)
            got = epochs((pool, sampler), n=1)
            result = {"equal": same(expected, got), "role": getattr(pool._share, "role", None),
                      "lowest_free": os.dup(0)}
            os.close(result["lowest_free"])
        finally:
            for fd in held:
                os.close(fd)
        meet("done")
        return result
    raise ValueError(CASE)


def share_partial() -> dict:
    """Loaders only some of the group's ranks build (the test sets POOLLOADER_SHARE_WAIT):
    one on rank 0 alone, then one on rank 1 alone, each built twice at one place, and one
    rank 1 builds only after rank 0 took its first batch. Each rank's batches are its
    DataLoader's whoever leads."""
    torch.manual_seed(0)
    expected = epochs(shared_loader(DataLoader, "torch"), n=1)
    result: dict = {}

    def build(phase):
        started = time.monotonic()
        torch.manual_seed(0)
        pool, _ = shared_loader(PoolLoader, phase, share_batches=SHARE_GROUP)
        return pool, time.monotonic() - started

    for alone in (0, 1):
        runs = []
        for _ in range(2):  # the same place twice
            if RANK != alone:
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pool, built = build(f"alone{alone}")
                started = time.monotonic()
                got = [[t.clone() for t in b] for b in pool]
            share = pool._share
            runs.append({"built": built, "took": time.monotonic() - started,
                         "role": getattr(share, "role", None),
                         "awaited": sorted(getattr(share, "awaited", ())),
                         "equal": same(expected, [got]),
                         "warnings": [str(w.message) for w in caught
                                      if "share_batches" in str(w.message)]})
            del pool, share
        result[f"alone{alone}"] = runs
        meet(f"alone{alone}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if RANK == 1:
            meet("late_first")  # rank 0 took its first batch
        pool, _ = build("late")  # one place on both ranks
        if RANK == 0:
            it = iter(pool)
            got = [[t.clone() for t in next(it)]]
            meet("late_first")
            meet("late_built")  # rank 1 built its loader: the group was made without it
            got += [[t.clone() for t in b] for b in it]
        else:
            meet("late_built")
            got = [[t.clone() for t in b] for b in pool]
    result["late"] = {"role": getattr(pool._share, "role", None),
                      "equal": same(expected, [got]),
                      "warnings": [str(w.message) for w in caught
                                   if "share_batches" in str(w.message)]}
    meet("done")
    return result


def share_cuda(device: bool) -> dict:
    from cuda_standin import SimCuda

    from poolloader.cuda import gate as cuda_gate
    n = 240  # 30 batches an epoch: more than the leader's slots, so slots are reused
    torch.manual_seed(0)
    expected = epochs(shared_loader(DataLoader, "torch", True, n=n))
    torch.manual_seed(0)
    pool, sampler = shared_loader(PoolLoader, "pool", True, n=n, share_batches=SHARE_GROUP,
                                  **({"device": "cuda"} if device else {"pin_memory": True}))
    sim = SimCuda()
    pool._cuda_runtime = sim  # the only stand-in: the CUDA runtime
    side = sim.stream(0, "side")  # the rank's copy stream (a prefetcher's), torch-made
    link = pool._share
    got, registered, slot_views, most_held_back = [], [], [], 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        copies = []
        for batch in pool:
            if device:  # the stager's copies, queued on its stream
                copies.append(batch)
            else:
                slot_views.append(sim._registered_range(
                    batch[2].data_ptr(), batch[2].numel() * batch[2].element_size()))
                copies.append([sim.copy(t.contiguous(), side) for t in batch])
            del batch
            if epoch == 0:
                sim.run_all()
            if RANK == 1:
                most_held_back = max(most_held_back, link.cuda.pending)
        registered.append(sim.register_calls)
        sim.run_all()  # epoch 1: only now does any copy read its slot
        got.append([[t.clone() for t in b] for b in copies])
        del copies
    result = {"role": link.role if link is not None else None,
              "equal": same(expected, got), "batches": len(got[0]), "registered": registered,
              "slot_views": all(slot_views), "detaches": pool.stats.detaches,
              "growths": pool.stats.cooling_growths}
    if RANK == 1:
        result.update(mapped=link.segments_mapped, registrations=link.cuda.registrations,
                      most_held_back=most_held_back)
    meet("iterated", ranks=SHARE_GROUP)
    del pool, link, sampler
    gc.collect()
    cuda_gate.finish_deferred()  # what this process's next gate would do first
    result.update(unregistered=sim.unregister_calls, still_registered=len(sim.registered),
                  violations=sim.violations, errors=[c for c in sim.calls if c[1] == "clear_error"],
                  children_gone=proc.wait_gone(children(), 10.0), children=children())
    meet("done", ranks=SHARE_GROUP)
    return result


def drain(it) -> tuple:
    """(the error iterating the rest of `it` raised, as "Type: message", or None; the
    seconds it took)."""
    began = time.monotonic()
    try:
        for _ in it:
            pass
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return error, time.monotonic() - began


def pool_inodes() -> list:
    """The inodes of this process's pool: its control and slot segments (not the node
    segment, which the node's processes keep)."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) > 5 and ("poolloader-control" in fields[5] or "poolloader-slot" in fields[5]):
                found.add(int(fields[4]))
    return sorted(found)


def start_inodes(pid) -> set:
    """The inodes of the start payloads (poolloader.main.startup) process `pid` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return {int(fields[4]) for fields in (line.split(maxsplit=5) for line in f)
                if len(fields) > 5 and "poolloader-start" in fields[5]}


def read_pid(rank: int) -> int:
    return read("pid", rank)


def run_rank(case_main) -> None:
    """A rank's life, for this script and the ones that reuse its helpers: note its pid,
    join torch.distributed under DIST, run `case_main()` and write its result to
    OUT/rank<RANK>.json; exit 1 with the traceback printed if it raised."""
    note("pid", os.getpid())
    if DIST:
        torch.distributed.init_process_group("gloo", init_method=f"file://{DIST}", rank=RANK,
                                             world_size=WORLD)
    try:
        result = case_main()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_rank(main)
