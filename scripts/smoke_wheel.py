"""Smoke test of an installed poolloader: a real PoolLoader with 2 workers, under fork
and spawn, yields the same batches as torch's DataLoader.

Run it from outside the source tree, with the interpreter of the venv the wheel went
into; it refuses to run on a poolloader imported from a checkout. `--no-toolchain`
also checks that this venv has no C compiler on PATH and no Cython, i.e. that the
extension really came prebuilt. Exits non-zero on any difference.

    python scripts/smoke_wheel.py [--no-toolchain]
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import poolloader
from poolloader import PoolLoader
from poolloader.shm._ring import TIMED_WAIT


class Samples(Dataset):
    """37 samples (batches of 4: the last one short) of a tensor, an int and a str."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"image": torch.arange(15, dtype=torch.float32).reshape(3, 5) + i, "index": i,
                "name": f"sample-{i}"}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-toolchain", action="store_true",
                        help="also fail if a C compiler is on PATH or Cython is importable")
    args = parser.parse_args()

    package = Path(poolloader.__file__).resolve().parent
    if (package.parent / "setup.py").exists():
        sys.exit(f"poolloader was imported from the checkout {package.parent}, not from an "
                 "installed wheel: run this from another directory")
    if args.no_toolchain:
        found = {name: shutil.which(name) for name in ("cc", "gcc", "clang", "c++")}
        if any(found.values()) or importlib.util.find_spec("Cython") is not None:
            sys.exit(f"a toolchain is reachable: compilers {found}, "
                     f"Cython {importlib.util.find_spec('Cython')}")

    dataset = Samples()
    expected = list(DataLoader(dataset, batch_size=4, num_workers=0))
    for method in ("fork", "spawn"):
        loader = PoolLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=method,
                            timeout=120)
        got = list(loader)
        if len(got) != len(expected) or not all(map(same, got, expected)):
            sys.exit(f"{method}: PoolLoader's {len(got)} batches differ from DataLoader's "
                     f"{len(expected)}")
    print(f"ok: poolloader {poolloader.__version__} from {package} (timed waits: {TIMED_WAIT}), "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}: {len(expected)} batches "
          "from 2 workers under fork and spawn equal DataLoader's"
          + ("; no compiler on PATH, no Cython" if args.no_toolchain else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
