"""Another revision of this repository, side by side, and one arm per fresh
interpreter.

Baselines: `baseline_tree` / `remove_baseline_tree` (a git revision of this
repository in a worktree, importable by a child process).

Arms (bench/throughput.py, bench/memory.py): the script runs itself with
`--child JSON` through `run_arm`, in its own session with a deadline; the child
calls `use_tree` and `check_tree`, measures, reports `arm_leftovers` and prints
one JSON line.

Nothing here imports torch or poolloader at import time.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

from common import REPO, BenchError
from procs import SHM_DIR, session_pids, shm_names, wait_no_children


def baseline_tree(rev: str, where: str) -> str:
    """A worktree of git revision `rev` at `where`/baseline, importable: its compiled
    modules are copied from this tree when their sources are the same, else built there.
    Children started with PYTHONPATH=<tree> import its poolloader (common.py, which this module
    imports, puts the repository first on sys.path: a child must import this module before
    `use_tree` moves <tree> in front).
    Remove it with `remove_baseline_tree(where)`."""
    tree = os.path.join(where, "baseline")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", tree, rev], check=True)
    # the compiled modules live in poolloader/shm/; a revision from before that layout
    # (or with other sources) is built in its own tree
    same = subprocess.run(["git", "-C", REPO, "diff", "--quiet", rev, "--", "poolloader/shm/_ring.pyx",
                           "poolloader/shm/_shm.pyx", "csrc", "setup.py"]).returncode == 0
    same = same and os.path.isdir(os.path.join(tree, "poolloader", "shm"))
    built = [f for f in os.listdir(os.path.join(REPO, "poolloader", "shm")) if f.endswith(".so")]
    if same and built:
        for f in built:
            shutil.copy2(os.path.join(REPO, "poolloader", "shm", f),
                         os.path.join(tree, "poolloader", "shm", f))
    else:
        build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=tree,
                               capture_output=True, text=True)
        if build.returncode:
            tail = "\n".join((build.stderr or build.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"building the compiled modules of {rev} in {tree} failed "
                               f"(setup.py build_ext --inplace, exit {build.returncode}):\n{tail}")
    return tree


def remove_baseline_tree(where: str) -> None:
    """Undo `baseline_tree(rev, where)`: unregister the worktree and delete all of
    `where`; failures are ignored (a run that failed half-way still cleans up)."""
    subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", os.path.join(where, "baseline")],
                   capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


# one arm in a fresh interpreter (bench/throughput.py, bench/memory.py): the script runs
# itself with `--child JSON`, the child measures and prints one JSON line

SKIPPED = "skipped"  # the key a child prints instead of figures when its arm cannot run here


def use_tree(tree: str) -> None:
    """In an arm's child: put `tree` (this repository or a `baseline_tree`) first on
    sys.path in this repository's place; call it before importing poolloader."""
    if tree != REPO:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != REPO]
        sys.path.insert(0, tree)


def check_tree(module, tree: str) -> None:
    """In an arm's child: exit saying so unless `module` (poolloader) came from `tree`."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
    if where != tree:
        raise SystemExit(f"imported {module.__name__} from {where}, not from {tree}")


def arm_leftovers(names0: set[str], pids: Iterable[int], timeout: float = 10.0) -> list[str]:
    """In an arm's child, after its loader shut down: what the arm left, waiting at most
    `timeout` s for it to go. Live children (multiprocessing's resource tracker and
    forkserver excepted) and the /dev/shm names that appeared since `names0` carrying
    this process's pid or one of `pids` (poolloader's POSIX names and torch's both do;
    found by token, so nothing of either tree is imported)."""
    ours = {str(os.getpid())} | {str(p) for p in pids}
    deadline = time.monotonic() + timeout
    while True:
        children = wait_no_children(0)
        names = sorted(x for x in shm_names() - names0 if ours & set(x.replace("_", "-").split("-")))
        if (not children and not names) or time.monotonic() > deadline:
            return [f"child pid {c}" for c in children] + [f"{SHM_DIR}/{x}" for x in names]
        time.sleep(0.05)


def run_arm(script: str, spec: dict, timeout: float, cgroup: bool = False) -> dict:
    """Run one arm: `script --child JSON(spec)` in a fresh interpreter importing
    `spec["tree"]`, in its own session; past `timeout` the whole session (the arm and its
    workers) is killed, so nothing runs into the next arm. Returns the child's last JSON
    line less its `left` list; raises BenchError when the arm ran too long, failed, left
    something behind (`left`, from `arm_leftovers`) or printed `SKIPPED` (with why).

    `cgroup`: the arm runs in a memory cgroup of its own (bench/cgroups.py); the
    result gets `cgroup_peak_mib` (None, and `cgroup_skipped` saying why, where one
    cannot be made)."""
    import cgroups

    group, why_not = cgroups.MemoryCgroup.make(spec["arm"]) if cgroup else (None, None)
    try:
        result = _run_arm(script, spec, timeout, group)
        if cgroup:
            result["cgroup_peak_mib"] = None if group is None else group.peak() / cgroups.MIB
            result["cgroup_skipped"] = why_not
        return result
    finally:
        if group is not None:
            group.close()


def _run_arm(script: str, spec: dict, timeout: float, group) -> dict:
    env = dict(os.environ, PYTHONPATH=spec["tree"])
    proc = subprocess.Popen([sys.executable, script, "--child", json.dumps(spec)], cwd=spec["tree"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=None if group is None else group.preexec())
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, stderr = proc.communicate(timeout=30)
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise BenchError(f"arm {spec['arm']} ran past {timeout:.0f} s (killed); "
                         f"its stderr ended: {tail or '(nothing)'}") from None
    if proc.returncode:
        raise BenchError(f"arm {spec['arm']} exited {proc.returncode}: "
                         f"{(stderr.strip().splitlines() or [''])[-1]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    if SKIPPED in result:
        raise BenchError(f"{SKIPPED}: {result[SKIPPED]}")
    left = result.pop("left")
    if left:
        raise BenchError(f"arm {spec['arm']} left behind: {', '.join(left)}")
    return result
