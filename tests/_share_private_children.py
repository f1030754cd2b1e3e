"""One rank of test_share_private.py: `python _share_private_children.py CASE OUT_DIR [ARG]`.

Started as tests/_node_children.py is (test_node_pool._ranks), whose helpers it uses:
ranks 0 and 1 form a share_batches group (one data-parallel rank, the same sampler).

Cases:
  write ARG=""|"pin"  three epochs of DataLoader, then of PoolLoader(share_batches=[0, 1])
        (with "pin": pin_memory=True under the CPU stand-in of CUDA). In the first two
        epochs, for each batch both ranks clone it, then one rank (the follower for even
        batches, the leader for odd ones) writes every tensor of its batch in place
        while the other holds its own; the other records whether its batch changed.
        The third epoch writes nothing, and records, for each batch, the memory behind
        its largest tensor (the one that views the slot): the mapping's permissions and
        its resident and anonymous (copied) kilobytes. With "pin", each rank also queues
        a copy of every tensor, after the write, and records what the copies read once
        they ran, and whether the slot tensor viewed registered memory.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _node_children as nc  # noqa: E402  (its argv is ours: CASE OUT_DIR [ARG])
import proc  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from poolloader import PoolLoader  # noqa: E402

N = 96  # 12 batches an epoch a rank: more than the leader's slots, so slots are reused
EPOCHS, WRITE_EPOCHS = 3, 2
DELTA = 1000


def vma(address: int) -> dict:
    """The mapping of this process that holds `address`: its permissions, and its
    Rss and Anonymous kilobytes (/proc/self/smaps)."""
    found: dict = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                if found:
                    break
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    found = {"perms": fields[1], "inode": int(fields[4])}
            elif found and fields[0] in ("Rss:", "Anonymous:"):
                found[fields[0][:-1].lower()] = int(fields[1])
    return found


def write(batch) -> None:
    for t in batch:
        t.add_(DELTA)  # in place, as x.sub_(mean) would


def write_case(pin: bool) -> dict:
    expected = nc.epochs(nc.shared_loader(DataLoader, "torch", n=N), n=EPOCHS)
    sim = side = None
    kw = {}
    if pin:
        from cuda_standin import SimCuda
        sim = SimCuda()
        side = sim.stream(0, "side")
        kw = {"pin_memory": True}
    pool, sampler = nc.shared_loader(PoolLoader, "pool", n=N, share_batches=nc.SHARE_GROUP, **kw)
    if sim is not None:
        pool._cuda_runtime = sim
    role = pool._share.role if pool._share is not None else None
    me = nc.SHARE_GROUP.index(nc.RANK)
    got, changed, writable, memory, copies_ok, slot_views = [], [], [], [], [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = []
        for k, batch in enumerate(pool):
            clone = [t.clone() for t in batch]
            batches.append(clone)
            step = f"{epoch}.{k}"
            if epoch < WRITE_EPOCHS:
                writer = (k + 1) % 2  # the follower (rank 1) on even batches
                nc.meet(f"got.{step}", nc.SHARE_GROUP)
                if me == writer:
                    write(batch)
                    writable.append(all(torch.equal(t, c + DELTA) for t, c in zip(batch, clone)))
                nc.meet(f"wrote.{step}", nc.SHARE_GROUP)
                if me != writer:
                    changed.append([step, not all(torch.equal(t, c) for t, c in zip(batch, clone))])
                if sim is not None:
                    slot_views.append(sim._registered_range(
                        batch[2].data_ptr(), batch[2].numel() * batch[2].element_size()))
                    queued = [sim.copy(t.contiguous(), side) for t in batch]
                    sim.run_all()  # the copies read the host bytes now, as a DMA would
                    own = [c + DELTA for c in clone] if me == writer else clone
                    copies_ok.append(all(torch.equal(q, o) for q, o in zip(queued, own)))
                    del queued
                nc.meet(f"checked.{step}", nc.SHARE_GROUP)
            else:
                memory.append(vma(batch[2].data_ptr()))
            del batch
        got.append(batches)
    result = {"role": role, "equal": nc.same(expected, got), "batches": len(got[0]),
              "changed": [s for s, c in changed if c], "checked": len(changed),
              "writable": writable, "memory": memory}
    if sim is not None:
        result.update(copies_ok=copies_ok, slot_views=slot_views)
    nc.meet("iterated", nc.SHARE_GROUP)
    del pool, sampler
    gc.collect()
    if sim is not None:
        from poolloader.cuda import gate as cuda_gate
        cuda_gate.finish_deferred()
        result.update(violations=sim.violations, still_registered=len(sim.registered),
                      errors=[c for c in sim.calls if c[1] == "clear_error"])
    result["children_gone"] = proc.wait_gone(nc.children(), 10.0)
    nc.meet("done", nc.SHARE_GROUP)
    return result


if __name__ == "__main__":
    nc.note("pid", os.getpid())
    if nc.CASE != "write":
        raise SystemExit(f"unknown case {nc.CASE!r}")
    result = write_case(nc.ARG == "pin")
    with open(os.path.join(nc.OUT, f"rank{nc.RANK}.json"), "w") as f:
        json.dump(result, f)
