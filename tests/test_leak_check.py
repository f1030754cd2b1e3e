"""The autouse leak check (tests/conftest.py) judges only what this test's processes
made or hold: another job's names on the machine never fail a test, ours always do."""
import os
import subprocess
import sys
import uuid

import conftest
import proc


def _unheld_name(name: str) -> str:
    """Create /dev/shm/<name> and close it: a name nobody maps or holds open."""
    path = os.path.join(conftest.SHM_DIR, name)
    with open(path, "xb"):
        pass
    return path


def test_an_unheld_name_without_a_pid_is_another_jobs():
    # what another job's multiprocessing leaves: sem.mp-<random>, no pid, no holder
    path = _unheld_name(f"sem.mp-pltest{uuid.uuid4().hex[:6]}")
    try:
        tree = proc.tree(proc.process_table())
        assert conftest._foreign({os.path.basename(path)}, tree) == {os.path.basename(path)}
    finally:
        os.unlink(path)


def test_names_of_this_tree_are_blamed_and_other_pids_are_not():
    mine = os.path.basename(_unheld_name(f"pltest-{os.getpid()}-{uuid.uuid4().hex[:6]}"))
    # a pid that is not ours: an exited child's, looked at as if another job's
    other = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, timeout=60)
    theirs = os.path.basename(_unheld_name(f"pltest-{other.stdout.strip()}-{uuid.uuid4().hex[:6]}"))
    held_path = os.path.join(conftest.SHM_DIR, f"sem.mp-pltest{uuid.uuid4().hex[:6]}")
    held = open(held_path, "xb")  # held by this process: ours, whatever it is called
    try:
        tree = {os.getpid()}
        foreign = conftest._foreign({mine, theirs, os.path.basename(held_path)}, tree)
        assert foreign == {theirs}
    finally:
        held.close()
        for name in (mine, theirs, os.path.basename(held_path)):
            os.unlink(os.path.join(conftest.SHM_DIR, name))
