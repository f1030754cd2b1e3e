"""How the local ranks' loaders meet (poolloader.main.rendezvous): above 1024 open
descriptors, and a rendezvous name someone else holds.

Loaders meeting by where they are built is tested end to end in test_node_pool.py
(test_loaders_meet_by_where_they_are_built) and through torchrun in
test_train_script.py (examples/ddp_eval.py)."""
from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
from test_node_pool import _ranks

from poolloader import PoolLoader
from poolloader.main import rendezvous
from poolloader.shm import fork

HERE = os.path.dirname(os.path.abspath(__file__))

MANY_DESCRIPTORS = textwrap.dedent("""
    import os, resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    assert min(held) < 1024 < max(held)
    from poolloader import PoolLoader
    batches = [b.tolist() for b in PoolLoader(list(range(10)), batch_size=3, num_workers=2)]
    assert batches == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]], batches
    print("ok", max(held))
""")


def test_a_process_with_1100_descriptors_open_iterates_a_default_loader():
    """A fresh process (the memfd probe runs once per process): the probe's wait and
    every other one poolloader makes takes descriptors above 1024 (select() raised
    ValueError there, so iter() failed)."""
    done = subprocess.run([sys.executable, "-c", MANY_DESCRIPTORS], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr


def test_a_share_group_with_1100_descriptors_open_shares(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_fds", 2)
    assert codes == [0, 0], logs
    assert [r["role"] for r in results] == ["leader", "follower"], results
    for r in results:
        assert r["equal"] and r["lowest_free"] > 1024, (results, logs)


HOLDER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(socket.AF_UNIX, getattr(socket, sys.argv[2]))
    s.bind(bytes.fromhex(sys.argv[1]))
    s.listen(1)
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("kind", ["SOCK_SEQPACKET", "SOCK_STREAM"])
def test_a_name_held_by_another_job_is_an_error_that_says_so(monkeypatch, kind):
    """Another process (not a local rank of this job) holds the name this loader meets
    at: the error names it and says what EADDRINUSE means here, instead of a rank joining
    it or waiting. A name held with a socket of another type is another name (Linux keys
    abstract names by type): the loader meets as if it were free."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"pltest-{uuid.uuid4().hex}")
    monkeypatch.setenv("POOLLOADER_NODE_RANK_PID", str(os.getpid()))
    monkeypatch.setattr(rendezvous, "build_site", lambda: "the-place")
    group = rendezvous.local_group()
    assert group is not None
    k = rendezvous._builds["node", "the-place"]
    name = rendezvous.address(group.run_key, f"node/the-place/{k}")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name.hex(), kind], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        if kind == "SOCK_STREAM":
            loader = PoolLoader(list(range(4)), num_workers=2, node_pool=True)
            assert type(loader._node).__name__ == "NodeHost"
            assert [int(b) for b in loader] == [0, 1, 2, 3]
            del loader
            gc.collect()  # its node's processes go with it
            return
        with pytest.raises(RuntimeError) as raised:
            PoolLoader(list(range(4)), num_workers=2, node_pool=True)
        message = str(raised.value)
        assert f"by pid {holder.pid} of uid {os.getuid()}" in message, message
        assert "EADDRINUSE" in message and "not a local rank of this job" in message
        assert "node_pool=False" in message
    finally:
        holder.kill()
        holder.wait(10)


def test_the_name_carries_what_only_the_job_knows(monkeypatch):
    """Two jobs that differ only in what /proc shows no other user (torchrun's run id,
    its master port, its log folder's random name) get other names; the local ranks of
    one job, the same."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("POOLLOADER_NODE_RANK_PID", str(os.getpid()))
    names = set()
    logs = "/tmp/torchelastic_{}/run_{}/attempt_0/{}/error.json"
    for run_id, port, folder in (("a", "29500", "x"), ("b", "29500", "x"), ("a", "29501", "x"),
                                 ("a", "29500", "y")):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        monkeypatch.setenv("MASTER_PORT", port)
        for local_rank in (0, 1):  # each rank's own error file: the same name
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", logs.format(folder, folder, local_rank))
            names.add(rendezvous.address(rendezvous.local_group().run_key, "node/x/0"))
    assert len(names) == 4


def test_one_message_protocol_carries_any_size_and_descriptors_and_never_blocks_a_reader():
    """rendezvous's messages, over the SOCK_SEQPACKET pair both the node pool and
    share_batches use: a message of many records arrives whole and in order, with the
    descriptors sent with it; a reader that must not wait gets BlockingIOError while
    nothing is there; a message over MAX_MESSAGE is refused before anything is sent; a
    peer that closed with our messages unread still delivers what it sent (Linux reports
    ECONNRESET once first), then ConnectionError."""
    a, b = socket.socketpair(socket.AF_UNIX, rendezvous.KIND)
    r, w = os.pipe()
    try:
        a.settimeout(10)
        b.settimeout(10)
        with pytest.raises(BlockingIOError):
            rendezvous.receive(b, wait=False)
        big = {"configs": os.urandom(5 * rendezvous.RECORD + 123), "n": 7}
        assert len(rendezvous.pack(big)) == 6
        sender = threading.Thread(target=rendezvous.send, args=(a, big, [r]))
        sender.start()  # more than the socket buffer holds: sent while read
        message, fds = rendezvous.receive(b)
        sender.join(10)
        assert message == big and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"  # the pipe's read end, received
        fork.release(fds[0])
        rendezvous.send(a, ("small",), wait=False)
        assert rendezvous.receive(b, wait=False) == (("small",), [])
        with pytest.raises(ValueError, match="a test message takes .* more than the"):
            rendezvous.pack(b"x" * (rendezvous.MAX_MESSAGE + 1), "a test message")
        # b sends, then a sends back and closes with b's message unread
        rendezvous.send(b, ("unread",))
        rendezvous.send(a, ("one",))
        rendezvous.send(a, ("two",))
        rendezvous.close_socket(a)
        assert rendezvous.recv(b) == ("one",)
        assert rendezvous.recv(b) == ("two",)
        with pytest.raises(ConnectionError):
            rendezvous.recv(b)
    finally:
        for s in (a, b):
            if s.fileno() >= 0:
                s.close()
        os.close(r)
        os.close(w)
