"""How the local ranks' loaders find each other: the node pool (poolloader.main.node)
and share_batches (poolloader.main.share) both meet here.

Who: `local_group()`, this rank's place among the job's ranks on this node (torchrun's
variables, else an initialised torch.distributed's store).

Where: loaders meet by what every rank agrees on, never by a per-process count: the
place in the program that builds them (`build_site`: the file and line of every frame
of the user's call stack, from the innermost outside poolloader and torch.utils.data
out, so one helper that builds the train and the evaluation loaders gives two places)
and the k-th build at that place in this process. Real scripts build some loaders on
some ranks only (evaluation on rank 0): such a loader meets nobody and is an ordinary
one, and a rank never joins a loader built at another place.

The name (`address`): an abstract Unix socket (nothing on disk or in /dev/shm; it goes
with its holder) named from the uid, the PID namespace, a hash of the job (torchrun's
agent, run id, node rank and restart, or the local ranks' pids) with a part no other
user can read (torchrun's run id, master port and the random name of its log folder,
from the environment, which /proc shows only to this user; through torch.distributed,
a random token each rank put in the store), the kind of meeting and the place. `meet`:
the first rank to bind the name hosts, the others connect; a name held by anyone else
is an error naming them. Both ends check the other's uid and that it is a local rank of
this job (SO_PEERCRED) before anything it sends is unpickled.

Messages, one protocol for both: a pickle over SOCK_SEQPACKET, in records of at most
RECORD bytes, each led by a byte that says whether another record of the message follows
(`pack`, `send`, `receive`); descriptors (a share leader's memfd segments) ride with the
first record (SCM_RIGHTS). A record keeps its boundary, so a reader that must not wait
(a share leader taking in its followers' releases) can ask for the next message without
blocking, and reads the rest of it at once: the sender writes a message's records back
to back. Every wait is `wait_readable`'s poll (no select(): a descriptor above 1024 is
fine).
"""
from __future__ import annotations

import array
import collections
import datetime
import errno
import hashlib
import os
import pickle
import secrets
import select
import socket
import struct
import threading
import time
import typing
from typing import NamedTuple

from poolloader.errors import user_frame
from poolloader.shm import fork

# Set by a rank when it joins its first node pool or share group, to its pid: a process
# that inherits torchrun's variables from a rank (a worker, a subprocess) is not that
# rank, and its loaders are ordinary ones (local_group).
RANK_PID_ENV = "POOLLOADER_NODE_RANK_PID"
TIMEOUT_ENV = "POOLLOADER_NODE_TIMEOUT"
# How long a rank waits for the loader it joins to answer, and a host for its physical
# processes to start (seconds; TIMEOUT_ENV overrides).
RENDEZVOUS_TIMEOUT = 120.0
SHARE_WAIT_ENV = "POOLLOADER_SHARE_WAIT"
# How long a share_batches group's ranks wait for each other before each loads on its own
# (the same batches): a follower for its leader's loader, a leader's first batch for its
# followers (seconds; SHARE_WAIT_ENV overrides). A loader only some ranks build (an
# evaluation on rank 0) costs it once per place in the program (poolloader.main.share).
SHARE_WAIT = 5.0
CONNECT_RETRY_S = 0.02  # between tries while the name is free or not yet listening
KIND = socket.SOCK_SEQPACKET  # every socket the local ranks' loaders meet and talk through
RECORD = 64 << 10  # a message's bytes per record (a record must fit the socket's buffer)
MAX_MESSAGE = 64 << 20  # a message's limit (a rank's workers' configs, a resume record)
_MAX_FDS = 4  # descriptors a message may carry (a share leader's: one segment)
_MORE, _LAST = b"\x01", b"\x00"  # a record's first byte: another record follows, or not
# builds per (kind, place) in this process: the k of the k-th build there
_builds: collections.Counter = collections.Counter()


class LocalGroup(NamedTuple):
    """This process's place among the job's ranks on this node."""

    rank: int  # local rank
    size: int  # local world size
    run_key: str  # the same on every local rank of this job, and only there
    ranks: tuple[int, ...] | None  # the node's global ranks by local rank (None: unknown)


def local_group() -> LocalGroup | None:
    """This rank's LocalGroup where 2 or more ranks of the job share this node; None
    otherwise, where node_pool=True is an ordinary PoolLoader. Under torchrun from its
    variables (LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID, GROUP_RANK, RANK);
    else from an initialised torch.distributed (mp.spawn, a launcher of one's own):
    see _dist_group."""
    env = os.environ
    if env.get(RANK_PID_ENV, str(os.getpid())) != str(os.getpid()):
        return None  # a child of the rank (RANK_PID_ENV)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    try:
        rank, size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        run_id = None
    if not run_id:  # not torchrun (a launcher may set LOCAL_RANK of its own)
        return _dist_group()
    if size < 2 or not 0 <= rank < size:
        return None
    try:
        first = int(env["RANK"]) - rank  # torchrun gives a node consecutive global ranks
        ranks: tuple[int, ...] | None = tuple(range(first, first + size))
    except (KeyError, ValueError):
        ranks = None
    # the agent's pid: torchrun's default run id, "none", is shared by every job; the run
    # id, master port and the agent's log folder (a random name inside a folder only
    # this user may list) as the part no other user can read (module docstring)
    logs = env.get("TORCHELASTIC_ERROR_FILE", "").split("/attempt_")[0]
    key = f"torchrun/{os.getppid()}/{run_id}/{env.get('GROUP_RANK', '0')}/" \
          f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{env.get('MASTER_PORT', '')}/{logs}"
    return LocalGroup(rank, size, key, ranks)


# The local ranks' pids where the group came from torch.distributed: then a peer must be
# one of them (peer_is_a_local_rank); and the group found for the current default
# process group (_dist_group), kept for that group only.
_dist_peers: set[int] = set()
_dist_found: list = []  # [(the default process group, LocalGroup or None)]: one at most


def _node_identity() -> str:
    """What two processes that can share memfd segments and abstract sockets share: the
    machine's boot, the user, the PID and network namespaces."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return (f"{boot}/{os.getuid()}/{os.stat('/proc/self/ns/pid').st_ino}/"
            f"{os.stat('/proc/self/ns/net').st_ino}")


def _dist_group() -> LocalGroup | None:
    """The LocalGroup from an initialised torch.distributed default process group.

    Once per process group, every rank of the world writes its node's identity, its pid
    and a random token to the group's store (keys poolloader/node/<rank>) and reads
    every rank's, bounded by rendezvous_timeout(): the ranks of this node by global rank
    are its local ranks. It needs every rank of the world to build a node-pool or
    share_batches loader (as every local rank must, under torchrun); the store is read
    once, not per loader. The run key is those ranks' pids and tokens: the same on each
    of them, and on no other job's."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        default = dist.group.WORLD
    except (ImportError, RuntimeError, AttributeError):
        return None
    if _dist_found and _dist_found[0][0] is default:
        return _dist_found[0][1]
    _dist_found.clear()  # an earlier, destroyed group's: not kept alive
    _dist_peers.clear()
    world, me = dist.get_world_size(), dist.get_rank()
    found = None
    if world >= 2:
        store = dist.distributed_c10d._get_default_store()
        keys = [f"poolloader/node/{r}" for r in range(world)]
        store.set(keys[me], f"{_node_identity()} {os.getpid()} {secrets.token_hex(8)}")
        timeout = rendezvous_timeout()
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise RuntimeError(
                f"PoolLoader(node_pool/share_batches): rank {me} waited {timeout:.0f} s for "
                f"every rank of the torch.distributed world ({world}) to build its loader; "
                f"ranks {missing} did not (each rank must build the same node-pool and "
                f"share_batches loaders). {TIMEOUT_ENV} sets the wait; node_pool=False and "
                "share_batches=None give this rank an ordinary loader.") from None
        entries = [store.get(k).decode().rsplit(" ", 2) for k in keys]
        here = [r for r, (identity, _pid, _token) in enumerate(entries)
                if identity == entries[me][0]]
        if len(here) >= 2:
            pids = [int(entries[r][1]) for r in here]
            _dist_peers.update(p for p in pids if p != os.getpid())
            found = LocalGroup(here.index(me), len(here),
                               "dist/" + "/".join(f"{entries[r][1]}.{entries[r][2]}" for r in here),
                               tuple(here))
    _dist_found.append((default, found))
    return found


def rendezvous_timeout() -> float:
    return env_seconds(TIMEOUT_ENV, RENDEZVOUS_TIMEOUT)


def share_wait() -> float:
    return env_seconds(SHARE_WAIT_ENV, SHARE_WAIT)


def env_seconds(name: str, default: float) -> float:
    """The environment variable `name` as seconds (>= 0), or `default` where it is unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{name}={value!r}: a number of seconds (>= 0)")
    return seconds


class Users:
    """Closed with its last user: this rank's loader and its live iterators (an
    iterator can outlive its loader), each counted by `acquire` and `release`."""

    _users = 0
    # Reentrant: release() runs in finalisers (weakref.finalize, __del__), which the
    # collector may start while this thread is inside acquire() or release().
    _users_lock = threading.RLock()

    def close(self) -> None:
        raise NotImplementedError

    def acquire(self) -> None:
        """One more user here (the loader, an iterator); `release` when it is gone."""
        with self._users_lock:
            self._users += 1

    def release(self) -> None:
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.close()


# -- where a loader is built --------------------------------------------------------------

def build_site() -> str:
    """The place in the user's code that is building a loader now (module docstring):
    every frame's file and line from the innermost outside poolloader, torch.utils.data
    and typing, outwards, as a short hash."""
    frame: typing.Any
    frame, _level = user_frame(skip=(typing.__file__,))
    lines = []
    while frame is not None:
        lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        frame = frame.f_back
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=8).hexdigest()


def place(kind: str, site: str) -> str:
    """`site` with the number of earlier builds of `kind` there in this process."""
    k = _builds[kind, site]
    _builds[kind, site] += 1
    return f"{kind}/{site}/{k}"


def address(run_key: str, where: str) -> bytes:
    """The abstract socket name of the meeting `where` (place()) of this job."""
    namespace = os.stat("/proc/self/ns/pid").st_ino
    run = hashlib.blake2b(f"{run_key}\n{where}".encode(), digest_size=12).hexdigest()
    return f"\0poolloader-{os.getuid()}-{namespace}-{run}".encode()


def first_difference(mine: dict, theirs: dict, whose: str) -> str | None:
    """The first key whose value differs, as "key: mine here, theirs on `whose`"."""
    for key in mine:
        if mine[key] != theirs.get(key):
            return f"{key}: {mine[key]!r} here, {theirs.get(key)!r} on {whose}"
    return None


# -- sockets --------------------------------------------------------------------------------

def held_socket() -> socket.socket:
    """A Unix socket a forked child closes at once (poolloader.shm.fork)."""
    with fork.creating():
        sock = socket.socket(socket.AF_UNIX, KIND)
        fork.hold(sock.fileno())
    return sock


def close_socket(sock: socket.socket | None) -> None:
    if sock is not None and sock.fileno() >= 0:
        fork.release(sock.detach())


def wait_readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether `sock` has something to read (or was closed) within `timeout` seconds
    (None: however long that takes)."""
    return _ready(sock, select.POLLIN, timeout)


def _ready(sock: socket.socket, event: int, timeout: float | None) -> bool:
    poller = select.poll()
    poller.register(sock.fileno(), event)
    return bool(poller.poll(-1 if timeout is None else max(0, int(timeout * 1000))))


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the other end."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def peer_is_a_local_rank(sock: socket.socket) -> bool:
    """Whether the other end is a process of this user, in this PID namespace, that is
    another local rank of this job: through torch.distributed, one whose pid the job's
    store gave (_dist_group); under torchrun, one whose parent is ours (the agent).
    Checked before anything it sends is unpickled."""
    pid, uid = peer(sock)
    if uid != os.getuid() or pid <= 0:
        return False
    if _dist_peers:
        return pid in _dist_peers
    return _parent_of(pid) == os.getppid()


def listen(name: bytes, what: str) -> socket.socket | None:
    """A socket bound to `name` and listening; None where the name is taken."""
    sock = held_socket()
    try:
        sock.bind(name)
        sock.listen(64)
        return sock
    except OSError as e:
        close_socket(sock)
        if e.errno != errno.EADDRINUSE:
            raise RuntimeError(f"{what}: cannot listen for the other local ranks: {e}") from None
    return None


def connect(name: bytes, what: str) -> socket.socket | None:
    """A socket connected to the local rank listening on `name`; None where nobody
    listens there. A holder that is not a local rank of this job is an error naming it:
    another user or job took the name first."""
    sock = held_socket()
    try:
        sock.connect(name)
    except (FileNotFoundError, ConnectionRefusedError):
        close_socket(sock)
        return None
    if not peer_is_a_local_rank(sock):
        pid, uid = peer(sock)
        close_socket(sock)
        raise RuntimeError(
            f"{what}: its rendezvous name {name[1:].decode()!r} is in use (EADDRINUSE) by "
            f"pid {pid} of uid {uid}, which is not a local rank of this job: another job or "
            "user holds it. node_pool=False / share_batches=None build this loader without "
            "meeting")
    return sock


def meet(name: bytes, deadline: float, what: str) -> tuple[bool, socket.socket]:
    """(True, a socket listening on `name`) for the first local rank to come, or (False,
    a socket connected to that rank's) for the others. Where the name is taken but
    nobody listens (a holder closing), tries again until `deadline`."""
    while True:
        sock = listen(name, what)
        if sock is not None:
            return True, sock
        sock = connect(name, what)
        if sock is not None:
            return False, sock
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the loader built at the same place on another local "
                               f"rank held its rendezvous name without answering for "
                               f"{rendezvous_timeout():.0f} s ({TIMEOUT_ENV} sets the wait)")
        time.sleep(CONNECT_RETRY_S)


def accept(listener: socket.socket) -> socket.socket | None:
    """The next connection from a local rank of this job (after wait_readable); None for
    anyone else (closed at once) or when nothing was there."""
    try:
        with fork.creating():  # no fork between the accept and the hold
            conn, _ = listener.accept()
            fork.hold(conn.fileno())
    except (BlockingIOError, InterruptedError):
        return None
    if not peer_is_a_local_rank(conn):
        close_socket(conn)
        return None
    return conn


def pack(message, what: str = "a message") -> list[bytes]:
    """`message` as the records `send_packed` sends: packed once, sent to many. A
    ValueError names `what` where its pickle is over MAX_MESSAGE."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"{what} takes {len(data)} bytes pickled, more than the "
                         f"{MAX_MESSAGE} a message between local ranks may")
    return [(_MORE if start + RECORD < len(data) else _LAST) + data[start:start + RECORD]
            for start in range(0, len(data), RECORD)]


def send_packed(sock: socket.socket, records: list[bytes], fds=(), wait: bool = True) -> None:
    """Send a packed message (`pack`), `fds` with its first record. wait=False: a
    one-record message, or BlockingIOError (a full socket) and nothing sent."""
    if not wait:
        if len(records) > 1:
            raise ValueError("internal error: a message of several records sent without "
                             "waiting")
        if not _ready(sock, select.POLLOUT, 0):  # (a socket with a timeout would wait)
            raise BlockingIOError(errno.EAGAIN, "the socket is full")
    flags = 0 if wait else socket.MSG_DONTWAIT
    for k, record in enumerate(records):
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] \
            if k == 0 and fds else []
        sock.sendmsg([record], rights, flags)


def send(sock: socket.socket, message, fds=(), wait: bool = True) -> None:
    """One message (pickled, in records), and `fds` with it; as send_packed."""
    send_packed(sock, pack(message), fds, wait)


def receive(sock: socket.socket, wait: bool = True) -> tuple[typing.Any, list[int]]:
    """The next message and the descriptors that came with it (held: poolloader.shm.fork;
    the caller releases them). wait=True: waits as long as the socket's timeout
    (socket.timeout then); wait=False: BlockingIOError when no message is there. The
    rest of a message is read at once (its sender writes it back to back), bounded by
    rendezvous_timeout(). ConnectionError when the other end closed (after every
    message it sent was read). No wait holds the fork lock: each record is read once
    poll says it is there."""
    parts: list[bytes] = []
    fds: list[int] = []
    first, reset = True, False
    try:
        while True:
            limit = (sock.gettimeout() if wait else 0) if first else rendezvous_timeout()
            if not wait_readable(sock, limit):  # (a socket with a timeout would wait)
                if first and not wait:
                    raise BlockingIOError(errno.EAGAIN, "no message")
                raise socket.timeout("timed out")
            try:
                with fork.creating():  # a fork from another thread never inherits these
                    data, got, msg_flags = _recv_record(sock)
                    for fd in got:
                        fork.hold(fd)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                # Linux: the other end closed with messages of ours unread; that is
                # reported once, before the messages it sent first (read them, then the end)
                if reset:
                    raise ConnectionError("the other end closed the connection") from None
                reset = True
                continue
            fds += got
            if not data:
                raise ConnectionError("the other end closed the connection")
            if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ConnectionError(f"a record over {RECORD + 1} bytes or "
                                      f"{_MAX_FDS} descriptors (internal error)")
            parts.append(data[1:])
            if data[:1] == _LAST:
                return pickle.loads(b"".join(parts)), fds
            first = False
    except BaseException:
        for fd in fds:
            fork.release(fd)
        raise


def _recv_record(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """(bytes, descriptors, flags) of the next record, without waiting."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(RECORD + 1, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize),
                                           socket.MSG_DONTWAIT)
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[:len(cdata) - len(cdata) % fds.itemsize])
    return data, list(fds), flags


def recv(sock: socket.socket):
    """The next message, which carries no descriptor (as receive, waiting)."""
    message, fds = receive(sock)
    for fd in fds:
        fork.release(fd)
    return message
