"""A main process for test_zygote.py: `python _zygote_children.py METHOD`.

Defines its dataset class in __main__ (as a training script does), iterates a
PoolLoader of that start method (2 workers, one epoch), prints one JSON line (the
batches' values, the class's module name and its pid's parent as the workers saw them,
the zygote's and the workers' pids, taken while a second iterator holds its workers),
then waits to be killed (SIGKILL of main: nothing it started may outlive it)."""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

import torch
from torch.utils.data import Dataset

from poolloader import PoolLoader
from poolloader.worker import zygote


class MainDefined(Dataset):
    """Item i: (2 i, where this class was imported from, the worker's parent's pid)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"value": torch.tensor(2 * i), "module": type(self).__module__,
                "ppid": os.getppid()}


if __name__ == "__main__":
    method = sys.argv[1]
    loader = PoolLoader(MainDefined(), batch_size=2, num_workers=2,
                        multiprocessing_context=multiprocessing.get_context(method))
    batches = list(loader)
    held = iter(loader)
    next(held)
    print(json.dumps({
        "values": [b["value"].tolist() for b in batches],
        "modules": sorted({m for b in batches for m in b["module"]}),
        "ppids": sorted({p for b in batches for p in b["ppid"].tolist()}),
        "zygotes": zygote.pids(), "workers": held.worker_pids}), flush=True)
    time.sleep(120)  # the test SIGKILLs this process
