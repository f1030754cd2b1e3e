"""One local rank of test_node_workers_memory.py's node-pool case:
`python _node_workers_children.py emfile OUT_DIR`, with LOCAL_RANK, LOCAL_WORLD_SIZE, RANK,
WORLD_SIZE and TORCHELASTIC_RUN_ID as torchrun sets them.

Both ranks build PoolLoader(node_pool=True) with one node process. Rank 0 (the host,
whose child that process is) then lowers the process's RLIMIT_NOFILE below its lowest
free descriptor, so it cannot open anything more (EMFILE), and starts an epoch: the
process cannot open rank 0's pool, which lives. Rank 0 writes OUT_DIR/rank0.json: the
error next() raised ("Type: message", or None) and how long it took. Rank 1 keeps its
loader until then. An exception exits 1 with its traceback.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
from torch.utils.data import Dataset

from poolloader import PoolLoader

OUT = sys.argv[2]  # argv[1]: the case, as test_node_pool._ranks starts a child
RANK = int(os.environ["RANK"])
WAIT_S = 60.0


class Items(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((3,), float(i))


def lowest_free_fd(pid: int) -> int:
    used = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    return min(set(range(len(used) + 1)) - used)


def main() -> None:
    loader = PoolLoader(Items(), batch_size=2, num_workers=2, node_workers=1, node_pool=True,
                        timeout=30, multiprocessing_context="fork")
    done = os.path.join(OUT, "done")
    if RANK != 0:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)
        return
    try:
        (pid,) = loader._node.pids
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free_fd(pid), hard))
        began = time.monotonic()
        try:
            next(iter(loader))
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        result = {"error": error, "seconds": time.monotonic() - began}
        with open(os.path.join(OUT, "rank0.json"), "w") as f:
            json.dump(result, f)
    finally:
        open(done, "w").close()


if __name__ == "__main__":
    main()
