"""`python -m poolloader --share-batches 0,1` and `POOLLOADER_SHARE_BATCHES=0,1` (issue 44
item 7): the runner's share_batches is a list of global ranks, separated by commas.

The option's parsing runs in this process; the group runs as users run it: two ranks
under `python -m torch.distributed.run --standalone -m poolloader ...`, a script that
builds a plain DataLoader, bounded by a timeout (the job's process group killed after it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 150

SCRIPT = '''
import json, os, sys
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler


class Items(Dataset):
    """Item i: i in every value, and a tensor too big for the small block, so each batch
    views its slot."""

    def __len__(self):
        return 22

    def __getitem__(self, i):
        return torch.full((128, 128), float(i))


def backing_inode(tensor):
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end and len(fields) > 5 and "memfd:" in fields[5]:
                return int(fields[4])
    return None


dataset = Items()
# both ranks one data-parallel rank: the same batches, as a tensor-parallel pair
sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
expected = [[int(i) for i in batch] for batch in BatchSampler(sampler, 4, False)]
got, inodes = [], []
for batch in loader:
    got.append([int(row[0, 0]) for row in batch])
    inodes.append(backing_inode(batch))
share = getattr(loader, "_share", None)
result = {"type": type(loader).__name__, "share_batches": getattr(loader, "share_batches", None),
          "role": getattr(share, "role", None), "equal": got == expected,
          "batches": len(got), "inodes": inodes}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
'''


def _torchrun(tmp_path, runner_args, env):
    """Run SCRIPT on 2 ranks under torchrun and the runner; each rank's result."""
    script = tmp_path / "share_script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "poolloader", *runner_args, str(script), str(tmp_path)]
    child_env = dict(os.environ, **env,
                     PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=child_env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in leftovers([], str(tmp_path), settle_s=0)[1]:  # the ranks: own sessions
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=10)
        raise AssertionError(f"torchrun ran longer than {RUN_TIMEOUT_S} s:\n{output[-3000:]}") from None
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{output[-3000:]}"
    names, procs = leftovers([], str(tmp_path))
    assert not procs, f"processes of the job still alive: {procs}"
    results = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            results.append(json.load(f))
    return results, output


@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_script_under_the_runner_shares_the_batches_of_the_ranks_given(tmp_path, given):
    args, env = ((["--share-batches", "0,1"], {}) if given == "flag"
                 else ([], {"POOLLOADER_SHARE_BATCHES": " 1, 0"}))
    results, output = _torchrun(tmp_path, args, env)
    leader, follower = results
    for rank, r in enumerate(results):
        assert r["type"] == "PooledDataLoader", (r, output)
        assert r["share_batches"] == ([0, 1] if given == "flag" else [1, 0]), r
        assert r["equal"] and r["batches"] == 6, (rank, r, output[-3000:])
    assert (leader["role"], follower["role"]) == ("leader", "follower"), (results, output[-3000:])
    # shared: the same memfd pages behind each batch on both ranks
    assert None not in leader["inodes"] and leader["inodes"] == follower["inodes"], results


def test_pool_options_take_a_list_of_ranks_separated_by_commas(capsys):
    from poolloader.adopt import runner

    parse = runner._parser().parse_args
    for text, ranks in (("0,1", [0, 1]), (" 2 , 0 ", [2, 0]), ("3", [3]), ("none", None)):
        assert runner.pool_options(parse(["--share-batches", text]), environ={}) == {
            "share_batches": ranks}
        assert runner.pool_options(parse([]), environ={"POOLLOADER_SHARE_BATCHES": text}) == {
            "share_batches": ranks}
    assert runner.pool_options(parse(["--share-batches", "0,1"]),
                               environ={"POOLLOADER_SHARE_BATCHES": "2,3"}) == {
        "share_batches": [0, 1]}  # the flag wins
    # the runner's own options end before the script, which keeps its arguments
    assert runner.split_argv(["--share-batches", "0,1", "train.py", "--share-batches", "x"]) == (
        ["--share-batches", "0,1"], "train.py", None, ["--share-batches", "x"])
    for source, text in (("flag", "0,0"), ("flag", "-1"), ("env", "a"), ("env", "0;1"),
                         ("flag", "0,,1"), ("env", "[0,1]"), ("flag", "1_0"), ("env", "0 1")):
        args, env = (["--share-batches", text], {}) if source == "flag" else (
            [], {"POOLLOADER_SHARE_BATCHES": text})
        with pytest.raises(SystemExit) as exit_:
            runner.pool_options(parse(args), environ=env)
        assert exit_.value.code == 2
        where = f"--share-batches {text}" if source == "flag" else f"POOLLOADER_SHARE_BATCHES={text}"
        assert (f"{where}: share_batches takes distinct global ranks (whole numbers >= 0) "
                f"separated by commas, e.g. 0,1; got {text!r}") in capsys.readouterr().err
