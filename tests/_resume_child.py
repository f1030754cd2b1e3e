"""The new process of tests/test_resume.py: resume every saved state, run to the end.

    python _resume_child.py JOBS OUT

JOBS (torch.save'd, read with weights_only=True): a list of
(name, loader kwargs, state, epochs, caller RNG or None). For each job a fresh loader is built,
given the state with load_state_dict(), and iterated `epochs` times (the rest of
the saved epoch, then whole ones). With num_workers=0 the dataset draws from this
process's RNG, so the job carries the RNG the saving process had (the caller
restores it, as for the rest of its training). OUT gets {name: canonical batches, or
"error: ..."}. The global RNG is seeded differently from the saving process, so
nothing can match by accident of a shared seed.
"""
from __future__ import annotations

import random
import sys
import traceback
import warnings

import numpy as np
import torch
from _resume_cases import canon, make_loader


def main(jobs_path: str, out_path: str) -> None:
    warnings.simplefilter("ignore")
    jobs = torch.load(jobs_path, weights_only=True)
    results = {}
    for name, kwargs, state, epochs, caller_rng in jobs:
        torch.manual_seed(987654321)
        try:
            loader = make_loader(**kwargs)
            loader.load_state_dict(state)
            if caller_rng is not None:  # num_workers=0: the caller restores its own RNG
                torch_state, py_state, (name_, key, *rest) = caller_rng
                torch.set_rng_state(torch_state)
                random.setstate(py_state)
                np.random.set_state((name_, np.frombuffer(key, np.uint32).copy(), *rest))
            batches = []
            for _ in range(epochs):
                batches.extend(canon(b) for b in loader)
            results[name] = batches
            del loader
        except Exception:
            results[name] = "error: " + traceback.format_exc()
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
