"""One local rank of test_share_review.py and test_interrupts.py's share cases:
`python _review_children.py CASE OUT_DIR [ARG]`, started by test_node_pool's launcher
(`_ranks`) as tests/_node_children.py is, whose helpers it uses. 2 ranks, both in
share_batches=[0, 1] (rank 0 leads), the same sampler.

Cases:
  follower_interrupt  rank 1's third next() is interrupted (KeyboardInterrupt) as soon
        as link.receive() returned, before the counters; two epochs of persistent
        workers on both ranks, each compared with its DataLoader's.
  leader_interrupt  rank 0's third next() is interrupted as it enters _process_data.
  stall  rank 0 takes a batch, then waits 3 s before the next; both loaders have
        stall_warning=1: records the StallWarnings each rank got.
  end ARG=exit|collected|mid  rank 1 ends: "exit": its epoch done (its last batch
        still held), the process exits; "collected": its epoch done, its loader and
        iterator collected while the process goes on; "mid": its loader closed after 2
        batches of the epoch. Rank 0 then finishes its epoch and begins another, and
        records the "left" warnings it got.
  copy  each rank builds a share_batches loader and a node_pool loader, deep-copies and
        pickles each: records the copies' type and links, and whether one epoch of
        each copy equals the rank's DataLoader's.
"""
from __future__ import annotations

import copy
import gc
import os
import pickle
import sys
import time
import warnings

import _node_children as nc
from _node_children import RANK, SHARE_GROUP, meet, note, read, same, shared_loader
from test_interrupts import _AfterLine, _AtEntry
from torch.utils.data import DataLoader

from poolloader import PoolLoader
from poolloader.errors import StallWarning
from poolloader.main.follower_iter import FollowerIter
from poolloader.main.iterator import PoolLoaderIter

CASE, OUT, ARG = nc.CASE, nc.OUT, nc.ARG
K = 2  # the next() interrupted (0-based)


def interrupted_epochs(made, sampler, trap_factory, epochs=2):
    """Each epoch's batches (cloned), the k-th next() of epoch 0 armed with a trap when
    `trap_factory` is given; and the k at which KeyboardInterrupt came."""
    out, fired = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        it = iter(made)
        got, k = [], 0
        while True:
            trap = trap_factory() if (trap_factory and epoch == 0 and k == K) else None
            if trap is not None:
                sys.settrace(trap)
            try:
                batch = next(it)
            except StopIteration:
                break
            except KeyboardInterrupt:
                fired.append(k)
                k += 1
                continue
            finally:
                if trap is not None:
                    sys.settrace(None)
            got.append([t.clone() for t in batch])
            k += 1
        out.append(got)
    del it
    return out, fired


def expected_epochs(n=2, **kw):
    made, sampler = shared_loader(DataLoader, "torch", persistent=True, **kw)
    return nc.epochs((made, sampler), n=n)


def main() -> dict:
    if CASE in ("follower_interrupt", "leader_interrupt"):
        expected = expected_epochs()
        made, sampler = shared_loader(PoolLoader, "pool", persistent=True, timeout=60,
                                      share_batches=SHARE_GROUP)
        trapped = 1 if CASE == "follower_interrupt" else 0
        trap = None
        if RANK == trapped:
            if CASE == "follower_interrupt":
                def trap():
                    return _AfterLine(FollowerIter._next_host, "link.receive(")
            else:
                def trap():
                    return _AtEntry(PoolLoaderIter._process_data)
        got, fired = interrupted_epochs(made, sampler, trap)
        meet("done")
        first, want = got[0], expected[0]
        return {"fired": fired, "lost": len(want) - len(first),
                "equal0": same([want], [first]) or same([want[:K] + want[K + 1:]], [first]),
                "equal1": same([expected[1]], [got[1]])}
    if CASE == "stall":
        expected = expected_epochs(n=1)[0]
        made, sampler = shared_loader(PoolLoader, "pool", stall_warning=1.0,
                                      share_batches=SHARE_GROUP)
        sampler.set_epoch(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            it = iter(made)
            got = [[t.clone() for t in next(it)]]
            meet("first")
            if RANK == 0:
                time.sleep(3.0)  # rank 1 waits for batch 1 meanwhile
            got += [[t.clone() for t in b] for b in it]
        meet("done")
        stalls = [str(w.message) for w in caught if issubclass(w.category, StallWarning)]
        return {"stalls": stalls, "equal": same([expected], [got]),
                "leader_pid": read("pid", 0)}
    if CASE == "end":
        made, sampler = shared_loader(PoolLoader, "pool", share_batches=SHARE_GROUP)
        sampler.set_epoch(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            it = iter(made)
            batch = next(it)
            if RANK == 1:
                if ARG == "mid":
                    next(it)
                    del it, made, batch
                    gc.collect()
                    note("closed", True)
                else:
                    for batch in it:  # noqa: B007  (the last batch stays held, as a loop leaves it)
                        pass
                    if ARG == "collected":
                        del it, made
                        gc.collect()
                    note("closed", True)
                    if ARG == "exit":
                        return {"left": []}  # the process exits, its last batch held
                meet("leader_done")
                return {"left": []}
            # the leader: all but its epoch's end, then the follower ends, then its
            # epoch's end (StopIteration: it tells the follower) and another epoch
            got = 1
            for _ in range(len(made) - 1):
                next(it)
                got += 1
                if ARG == "mid" and got == 3:
                    read("closed", 1)
            if ARG != "mid":
                read("closed", 1)
            if ARG == "exit":
                pid, deadline = read("pid", 1), time.monotonic() + 30
                while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                    time.sleep(0.02)
                    try:  # a zombie until the launcher reaps it: gone once its socket closed
                        with open(f"/proc/{pid}/stat") as f:
                            if f.read().split()[2] == "Z":
                                break
                    except OSError:
                        break
            else:
                time.sleep(0.3)
            for _ in it:
                pass
            sampler.set_epoch(1)
            for _ in made:
                pass
        if ARG != "exit":
            meet("leader_done")
        left = [str(w.message) for w in caught if " left " in str(w.message)]
        return {"left": left}
    if CASE == "copy":
        expected = expected_epochs(n=1)[0]
        out = {}
        share_made, _ = shared_loader(PoolLoader, "pool", share_batches=SHARE_GROUP)
        node_made, _ = nc.loader(PoolLoader, node_pool=True)
        node_expected = nc.epochs(nc.loader(DataLoader), n=1)[0]
        for name, made, want in (("share", share_made, expected),
                                 ("node", node_made, node_expected)):
            linked = (made._share if name == "share" else made._node) is not None
            for how in ("deepcopy", "pickle"):
                try:
                    twin = copy.deepcopy(made) if how == "deepcopy" \
                        else pickle.loads(pickle.dumps(made))
                except Exception as e:
                    out[f"{name}_{how}"] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                twin.sampler.set_epoch(0)
                got = [[t.clone() for t in b] for b in twin]
                out[f"{name}_{how}"] = {
                    "linked": linked, "type": type(twin).__name__,
                    "node": twin._node is not None, "share": twin._share is not None,
                    "share_batches": twin.share_batches, "node_pool": twin.node_pool,
                    "equal": same([want], [got]), "error": None}
                del twin
                gc.collect()
        meet("done")
        return out
    raise SystemExit(f"unknown case {CASE!r}")


if __name__ == "__main__":
    nc.run_rank(main)
