"""Identical batches once: PoolLoader(share_batches=[global ranks]) under torchrun.

Ranks that consume the same batches (a tensor- or context-parallel group, ranks that
evaluate the same data) name each other in `share_batches`. On each node, the lowest
of the group's ranks there is the *leader*: its loader runs as any PoolLoader (its own
workers, or a node pool's) and, as it delivers each batch, hands the same slot to the
group's other ranks on the node, the *followers*. A follower starts no worker: it
maps the leader's segment (the memfd descriptor travels once per segment over an
abstract SOCK_SEQPACKET socket, SCM_RIGHTS) and decodes the batch from the same
physical pages, no copy. A group that spans nodes is made once per node.

What keeps it exact and safe:

* Each rank's batch is its own. Every rank, the leader included, decodes its batches
  from its own copy-on-write mapping of the slot (MAP_PRIVATE: the leader's pool keeps
  one beside each slot's shared mapping, poolloader.shm.pool `private_views`; a
  follower maps the descriptor it gets so): reads map the segment's pages, so no page
  is copied while nobody writes, and a write (x.sub_(mean)) copies only the page it
  touches, in that rank alone. Before the next batch in the slot is decoded, the rank
  drops the pages it copied (`renew`, MADV_DONTNEED), so the view shows the workers'
  new batch. The slot is then reused, so no view of this rank's last batch in it is
  alive (below); a batch kept longer keeps its segment (a detach). On CUDA the view is
  registered, and a pin cannot stay copy-on-write: its pages are made the rank's own
  before registration, kept, and each batch is copied in from the segment's shared
  mapping (docs/node.md, share_batches, "On CUDA").

* Each follower still iterates its own sampler and compares each batch's indices
  with the leader's: ranks whose samplers disagree get an error at the first batch
  that differs, never another rank's data. So share_batches needs a map-style
  dataset and in_order=True.
* A slot is reused only after the leader and every follower dropped the batch in it
  (poolloader.main.ledger: `shared`, `parked`); a follower says so with its next
  next(). If the leader runs out of slots meanwhile, it detaches the segment, as it
  does for a batch its own consumer keeps: the followers' mappings keep it alive.
* On CUDA (pin_memory=True, device=) each rank registers its own private mapping of a
  segment once, and a follower's release reaches the leader only once its own copies
  from the batch finished (poolloader.main.share_cuda); the leader's own copies gate it
  as any pool's (its SlotGate).
* A follower that exits gives back what it held (its socket closes) and the others go
  on, with a warning on the leader; a leader that exits, or whose iterator fails, is an
  error on every follower at its next wait (the socket closes, or says why).

Rendezvous (poolloader.main.rendezvous): the group's loaders meet where they are built
in the program, by a name that carries the job, the group's ranks on this node and that
place; the leader listens, each follower connects (waiting for the leader up to
POOLLOADER_NODE_TIMEOUT). Both ends check the peer (SO_PEERCRED) before anything is
unpickled, and a follower whose loader differs from the leader's (dataset class and
length, collate_fn, batch_size, drop_last, num_workers, worker_init_fn,
persistent_workers, the resume options: `fingerprint`) is refused at construction.
Every rank of a group must build its loaders at the same places (they consume the same
batches): a loader only the leader builds waits for its followers at its first batch.
"""
from __future__ import annotations

import collections
import os
import pickle
import socket
import struct
import threading
import time
import weakref
from typing import Any

from torch.utils.data import IterableDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from poolloader.cuda import gate
from poolloader.errors import StallWarning, WorkerDied, warn
from poolloader.main import node, rendezvous
from poolloader.main.share_cuda import FollowerCuda
from poolloader.resume.tracker import IteratorSetup, ResumeTracker
from poolloader.shm import fork
from poolloader.shm._shm import Mapping
from poolloader.shm.pool import renew
from poolloader.wire import codec
from poolloader.wire import slot_format as fmt

# Slots the leader's pool gets beyond its own needs: the batches its followers still
# hold when it takes a slot (the one each consumes and the one whose release rides
# with its next next()).
SHARE_SLACK = 2
_MAX_MESSAGE = 1 << 20  # a batch's indices, pickled, must fit: checked when sent
# How long the leader's send to a follower may wait for room (a follower that stopped
# taking its batches while the leader went on for thousands): then an error.
SEND_TIMEOUT_S = 30


def members(share_batches) -> list[int] | None:
    """The global ranks of `share_batches` (a list of ints or a ProcessGroup); None: none;
    []: a ProcessGroup this rank is not in."""
    if share_batches is None:
        return None
    try:
        import torch.distributed as dist
        if dist.is_available() and isinstance(share_batches, dist.ProcessGroup):
            return sorted(dist.get_process_group_ranks(share_batches))
        if dist.is_available() and dist.is_initialized() \
                and share_batches is dist.GroupMember.NON_GROUP_MEMBER:
            return []  # what new_group(ranks) gives a rank not in `ranks`: not a member
    except (ImportError, RuntimeError):
        pass
    try:
        ranks = list(share_batches)
    except TypeError:
        ranks = None
    if ranks is None or not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0
                                         for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"share_batches must be a list of distinct global ranks (ints >= 0) or "
                         f"a torch.distributed ProcessGroup, got {share_batches!r}")
    return sorted(ranks)


def plan(ranks: list[int] | None):
    """(leader's global rank, this rank, the followers on this node, run key) when this
    rank shares its batches with another rank of this node; None otherwise (not under
    torchrun or an initialised torch.distributed, not a member, or the only member
    here): an ordinary loader."""
    if ranks is None:
        return None
    # also on a rank outside the group: through torch.distributed every rank of the world
    # takes part in finding the node, once (rendezvous._dist_group)
    group = rendezvous.local_group()
    if not ranks or group is None or group.ranks is None:
        return None
    rank = group.ranks[group.rank]
    if rank not in ranks:
        return None
    here = [r for r in ranks if r in group.ranks]
    if len(here) < 2:
        return None
    return here[0], rank, here[1:], group.run_key


def check(loader) -> None:
    """What share_batches needs of a loader, checked at construction."""
    problems = []
    if loader.num_workers < 1:
        problems.append(f"num_workers={loader.num_workers} (the leader's workers make the "
                        "batches: use num_workers >= 1)")
    if isinstance(loader.dataset, IterableDataset):
        problems.append("an IterableDataset (each follower checks the leader's sample indices "
                        "against its own sampler's: use a map-style dataset)")
    if not loader.in_order:
        problems.append("in_order=False (the batches' order would differ between ranks)")
    backend = loader.shm_backend or os.environ.get("POOLLOADER_SHM_BACKEND")
    if backend not in (None, "", "memfd"):
        problems.append(f"shm_backend={backend!r} (followers map the leader's memfd segments)")
    if problems:
        raise ValueError("PoolLoader(share_batches=...) cannot share this loader's batches: "
                         + "; ".join(problems) + ". Or pass share_batches=None.")


def fingerprint(loader) -> dict:
    """What the loaders of a group must agree on: the node pool's (what the batches are
    made of), and what else makes a follower's own DataLoader batches (or its
    state_dict()) other than its leader's: a worker_init_fn, persistent workers (an
    epoch's augmentation continues the last one's RNG), the resume options."""
    mine = node.fingerprint(loader, loader.node_workers)
    mine.update({"worker_init_fn": node.qualified_name(loader.worker_init_fn),
                 "persistent_workers": loader.persistent_workers, "stateful": loader.stateful,
                 "snapshot_every_n_steps": loader.snapshot_every_n_steps})
    return mine


def _pack(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class _Follower:
    """The leader's view of one follower."""

    def __init__(self, sock: socket.socket, rank: int, pid: int):
        self.sock = sock
        self.rank = rank
        self.pid = pid
        self.sent: dict[int, int] = {}  # slot -> the generation whose descriptor it has
        self.held: collections.Counter = collections.Counter()  # (pool, slot, generation) -> batches
        self.last_epoch = 0  # the leader's epoch of the last batch sent to it
        self.finished = 0  # the last epoch it said it finished (its sampler ran out)
        self.said_bye = False  # it closed its loader (or its process exits normally)


class ShareLeader(node.Users):
    """The leader's side: listens for its followers, publishes each delivered slot.
    Open while its loader or one of its iterators lives (node.Users)."""

    role = "leader"

    def __init__(self, loader, listener: socket.socket, rank: int, followers: list[int],
                 timeout: float):
        self.rank = rank
        self.expected = list(followers)
        self._mine = fingerprint(loader)
        self._timeout = timeout
        self._followers: list[_Follower] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned_large = False  # tell_seen: a record too large to tell
        self._refused: list[str] = []
        self._failed: BaseException | None = None  # what stopped the accept thread
        self.ledger: Any = None  # the current iterator's SlotLedger (its `shared` counts)
        self._pool_id = 0  # one per ledger: a late release of an older pool's slot is stale
        self._epoch = 0
        self._n = 0
        self._published: tuple[int, int] | None = None  # (epoch, seq) published last
        self._ended = True
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name="poolloader-share-leader",
                                        daemon=True)
        self._thread.start()

    @property
    def weight(self) -> int:
        """The local ranks whose batches this leader's requests make (poolloader.main.node,
        in_flight): its own and its followers' here, which send none."""
        return 1 + len(self.expected)

    # -- joining ------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            self._accept_followers()
        except BaseException as e:  # told by _wait_joined, at once
            self._failed = e

    def _accept_followers(self) -> None:
        listener = self._listener
        while not self._closed and len(self._followers) < len(self.expected):
            if not rendezvous.wait_readable(listener, 0.25):
                continue
            if self._closed:
                return
            conn = rendezvous.accept(listener)
            if conn is None:
                continue
            try:
                conn.settimeout(30.0)
                hello = pickle.loads(conn.recv(_MAX_MESSAGE))
                theirs, rank = hello["fingerprint"], hello["rank"]
                difference = rendezvous.first_difference(theirs, self._mine, f"rank {self.rank}")
                if rank not in self.expected or any(f.rank == rank for f in self._followers):
                    difference = f"rank {rank} is not an expected follower {self.expected}"
                if difference is not None:
                    # the follower's words are its own ("here": its value)
                    mine = rendezvous.first_difference(self._mine, theirs, f"rank {rank}")
                    self._refused.append(f"rank {rank}: {mine or difference}")
                    conn.send(_pack(("refused", difference)))
                    rendezvous.close_socket(conn)
                    continue
                conn.send(_pack(("welcome",)))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                # blocking, but a send gives up after SEND_TIMEOUT_S (BlockingIOError),
                # and collect()'s receives never wait (MSG_DONTWAIT)
                conn.settimeout(None)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                struct.pack("ll", SEND_TIMEOUT_S, 0))
                with self._lock:
                    if self._closed:
                        raise ConnectionError("closed meanwhile")
                    self._followers.append(_Follower(conn, rank, rendezvous.peer(conn)[0]))
            except (OSError, ConnectionError, pickle.UnpicklingError, EOFError, KeyError,
                    TypeError):
                rendezvous.close_socket(conn)  # that follower gave up or sent nonsense

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self._timeout
        while len(self._followers) < len(self.expected):
            if self._failed is not None:
                raise RuntimeError(f"PoolLoader(share_batches=...): rank {self.rank} stopped "
                                   f"accepting the ranks it shares batches with: "
                                   f"{type(self._failed).__name__}: {self._failed}") \
                    from self._failed
            if not self._thread.is_alive():
                break
            if self._refused:
                raise ValueError(f"PoolLoader(share_batches=...): rank {self.rank} refused a "
                                 f"rank of its group whose loader differs: "
                                 f"{'; '.join(self._refused)}")
            if time.monotonic() > deadline:
                came = sorted(f.rank for f in self._followers)
                raise RuntimeError(
                    f"PoolLoader(share_batches=...): rank {self.rank} waited {self._timeout:.0f} s "
                    f"for the ranks {self.expected} it shares batches with, and only {came} "
                    "came (each must build the same loader at the same place in the program; "
                    f"{rendezvous.TIMEOUT_ENV} sets the wait)")
            time.sleep(0.005)

    # -- per epoch and per batch ---------------------------------------------------------
    def begin_epoch(self, ledger) -> int:
        """A new epoch of the leader's iterator whose slots are `ledger`'s."""
        if ledger is not self.ledger:  # a new pool: slot numbers start again
            self.ledger = ledger
            self._pool_id += 1
            for f in self._followers:
                f.sent, f.held = {}, collections.Counter()
        self._epoch += 1
        self._n = 0
        self._ended = False
        return self._epoch

    def publish(self, epoch: int, pool, slot: int, index, seq: int) -> None:
        """Hand `slot` (delivered now by the leader in its `epoch`, begin_epoch's, as its
        batch `seq`) to every follower; the ledger keeps the slot until each has dropped
        it. Before the leader decodes it. Once per batch: the leader's delivery that an
        interrupt cut short after this returned publishes nothing when it is redone."""
        if epoch != self._epoch:
            raise RuntimeError(
                f"PoolLoader(share_batches=...): rank {self.rank} iterates this loader "
                "with two iterators at once (an older one resumed after a newer one began "
                "its epoch); a share_batches loader has one live iterator: drop the old one")
        if self._published == (epoch, seq):
            return
        if self._n == 0:
            self._wait_joined()
        self.collect()
        generation = pool.generations[slot]
        key = (self._pool_id, slot, generation)
        body = _pack(("batch", self._epoch, self._n, key, pool.size(slot), index))
        if len(body) > _MAX_MESSAGE:
            raise ValueError(f"PoolLoader(share_batches=...): a batch's sample indices take "
                             f"{len(body)} bytes pickled, more than {_MAX_MESSAGE}")
        self._published, self._n = (epoch, seq), self._n + 1  # together: no call between
        for f in list(self._followers):
            try:
                if f.sent.get(slot) != generation:
                    socket.send_fds(f.sock, [body], [pool.descriptor(slot)])
                    f.sent[slot] = generation
                else:
                    f.sock.send(body)
            except BlockingIOError:
                raise self._stuck(f) from None
            except OSError:
                self._gone(f)
                continue
            f.held[key] += 1
            f.last_epoch = self._epoch
            self.ledger.share_out(slot, generation)

    def _stuck(self, f: _Follower) -> RuntimeError:
        return RuntimeError(
            f"PoolLoader(share_batches=...): rank {f.rank} (pid {f.pid}) has not taken the "
            f"batches rank {self.rank} shared with it for {SEND_TIMEOUT_S} s; the ranks of a "
            "share_batches group must consume the same batches at the same pace")

    def end_epoch(self, epoch: int) -> None:
        """The leader's `epoch` ended (or its iterator stopped): once, and only while
        it is the current one (a stale iterator's teardown ends nothing)."""
        if epoch == self._epoch and not self._ended:
            self._ended = True
            self._broadcast(("end", self._epoch, self._n))

    def tell_seen(self, epoch: int, told: list) -> None:
        """Before `epoch`'s first batch: the replies of the last epoch the leader took
        back undelivered, for each follower's resume state (FollowerIter)."""
        if epoch != self._epoch:
            return
        for one in told:  # one a message: a record is a few KB (its RNG states)
            body = _pack(("seen", self._epoch, one))
            if len(body) > _MAX_MESSAGE:
                if not self._warned_large:
                    self._warned_large = True
                    warn(f"PoolLoader(share_batches=...): a worker's resume record of "
                         f"{len(body)} bytes is over the {_MAX_MESSAGE} a message to the "
                         "followers may take, so their state_dict() lacks a batch their "
                         "leader's workers made and never delivered: it resumes a follower "
                         "exactly, not the rank that leads; keep the dataset's state_dict() "
                         "small or pass a larger snapshot_every_n_steps=")
                continue
            for f in list(self._followers):
                try:
                    f.sock.send(body)
                except BlockingIOError:
                    raise self._stuck(f) from None
                except OSError:
                    self._gone(f)

    def fail(self, epoch: int, why: str) -> None:
        if epoch == self._epoch:
            self._broadcast(("failed", why))

    def _broadcast(self, message) -> None:
        body = _pack(message)
        for f in list(self._followers):
            try:
                f.sock.send(body)
            except OSError:
                self._gone(f)

    def collect(self) -> None:
        """Take in every message the followers sent (never waits): releases, and the
        ends of their epochs and loaders."""
        for f in list(self._followers):
            if not self._read(f):
                self._gone(f)

    def _read(self, f: _Follower) -> bool:
        """Take in what `f` sent, without waiting; False once its socket closed."""
        while True:
            try:
                data = f.sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                return False
            message = pickle.loads(data)
            if message[0] == "finished":
                f.finished = max(f.finished, message[1])
                continue
            if message[0] == "bye":
                f.said_bye = True
                continue
            for key, forked in message[1]:
                key = tuple(key)
                if f.held[key] > 0:  # else a stale pool's, or no batch it had
                    f.held[key] -= 1
                    if forked:  # a child of the follower may still read it
                        self.ledger.share_abandon(key[1], key[2])
                    else:
                        self.ledger.share_back(key[1], key[2])

    def _gone(self, f: _Follower) -> None:
        """`f`'s socket closed. A warning only if it left while this rank's epoch still
        counts on it: it died (it closed without a word: killed, or its process ended
        without running finalisers), or it closed its loader in the middle of an epoch
        this rank is still in, having taken some of its batches and not finished it.
        A follower that finished its last epoch (or had not begun this one) and then
        closed its loader or exited, leaves quietly, whatever batch it still held."""
        with self._lock:
            if f not in self._followers:
                return
            self._followers.remove(f)
        try:
            self._read(f)  # what it said before it closed (its releases, "finished", "bye")
        except Exception:
            pass
        rendezvous.close_socket(f.sock)
        if self.ledger is not None:
            # its batches may outlive its socket (a batch still viewed after its loader
            # was collected): what it held is never rewritten, only detached
            for (_pool, slot, generation), count in f.held.items():
                if count > 0:
                    self.ledger.share_abandon(slot, generation)
        mid_epoch = not self._ended and f.last_epoch == self._epoch and f.finished < self._epoch
        if not self._closed and (not f.said_bye or mid_epoch):
            how = "exited or closed its loader" if not f.said_bye else \
                f"closed its loader during epoch {self._epoch}, before its end"
            warn(f"PoolLoader(share_batches=...): rank {f.rank} (pid {f.pid}), which shared "
                 f"rank {self.rank}'s batches, left ({how}); this rank "
                 "goes on without it (the slots it held get new segments when needed)")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            followers, self._followers = self._followers, []
        for f in followers:
            rendezvous.close_socket(f.sock)
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)  # it polls every 0.25 s
        rendezvous.close_socket(self._listener)


class ShareFollower(node.Users):
    """A follower's side: connected to its leader; maps the leader's segments. Open
    while its loader or one of its iterators lives (node.Users)."""

    role = "follower"

    def __init__(self, loader, address: bytes, leader: int, rank: int, timeout: float):
        self.leader = leader
        self.rank = rank
        self._timeout = loader.timeout
        self._stall_warning = loader.stall_warning
        self._sock: socket.socket | None = None
        # (pool id, slot) -> (generation, this rank's private view, the shared mapping
        # when the view is registered with CUDA, else None) of the leader's segments
        self._maps: dict[tuple[int, int], tuple[int, Mapping, Mapping | None]] = {}
        self.leases: dict = {}  # weakref to a Lease -> (pool id, slot, generation)
        # pin_memory / device=: registration and the reuse gate of this rank's copies,
        # made by its first iterator (cuda_side), closed with this link
        self.cuda: FollowerCuda | None = None
        self.segments_mapped = 0  # the leader's segments mapped so far (one descriptor each)
        self._released: collections.deque = collections.deque()
        self.on_release = self._released.append
        self._early: tuple | None = None  # a later epoch's message, read while this one ran
        # (epoch, n, mapping, key, indices) of the batch receive() returned last, until
        # its decode's lease holds it (settle): an interrupt between the two leaves it here
        self._handed: tuple | None = None
        self._epoch = 0
        deadline = time.monotonic() + timeout
        what = f"PoolLoader(share_batches=...) on rank {rank}"
        while True:
            sock = rendezvous.connect(address, socket.SOCK_SEQPACKET, what)
            if sock is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"PoolLoader(share_batches=...): rank {rank} found no leader to share "
                    f"batches with within {timeout:.0f} s: rank {leader} built no loader at "
                    f"the same place in the program ({rendezvous.TIMEOUT_ENV} sets the wait)")
            time.sleep(rendezvous.CONNECT_RETRY_S)
        self._sock = sock
        try:
            self.leader_pid = rendezvous.peer(sock)[0]
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            sock.send(_pack({"fingerprint": fingerprint(loader),
                             "rank": rank}))
            try:
                data = sock.recv(_MAX_MESSAGE)
            except OSError as e:
                data, why = b"", f"{type(e).__name__}: {e}"
            else:
                why = "it closed the connection"
            if not data:
                raise RuntimeError(f"PoolLoader(share_batches=...): rank {rank} reached its "
                                   f"leader, rank {leader} (pid {self.leader_pid}), which did "
                                   f"not take it in: {why}")
            answer = pickle.loads(data)
            if answer[0] == "refused":
                raise ValueError(
                    f"PoolLoader(share_batches=...): rank {rank}'s loader differs from rank "
                    f"{leader}'s, whose batches it would share, in {answer[1]}. The ranks of a "
                    "group must build the same loaders at the same place in the program.")
            sock.settimeout(30.0)
        except BaseException:
            self.close()
            raise

    def begin_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def cuda_side(self, loader, pin_memory: bool, pin_memory_device) -> FollowerCuda:
        """This rank's CUDA side, made once (the first iterator's pin_memory decision,
        as DataLoader's base iterator took it): gate and stager as an ordinary
        PoolLoader iterator's (poolloader.cuda.gate.setup)."""
        if self.cuda is None:
            self.cuda = FollowerCuda(*gate.setup(loader, pin_memory, pin_memory_device))
        return self.cuda

    def flush(self) -> None:
        """Tell the leader which batches this rank dropped: on CUDA, only once the copies
        this rank queued from them have finished (FollowerCuda)."""
        self._settle(None)  # before the releases below: its lease may be among them
        cuda = self.cuda
        if self._sock is None or not self._released and (
                cuda is None or cuda.gate is None or not cuda.gate.pending):
            return
        keys = []
        while self._released:
            key = self.leases.pop(self._released.popleft(), None)
            if key is not None:
                have = self._maps.get((key[0], key[1]))
                # a child forked while the batch was held inherited the mapping
                # (poolloader.shm.fork): the leader must never rewrite that segment
                forked = have is not None and have[0] == key[2] and have[1].forked
                if cuda is None:
                    keys.append((key, forked))
                else:
                    keys += cuda.release(key, forked)
        if cuda is not None:
            keys += cuda.ready()
        if keys:
            try:
                self._sock.send(_pack(("released", keys)))
            except OSError:
                pass  # the leader is gone: the next receive says so

    def _recv(self, what: str = "a message"):
        """The next message from the leader, and its descriptors; waits as DataLoader's
        next() does (timeout=, else as long as the leader lives and says nothing), with
        a StallWarning once per wait that lasts `stall_warning` s (`what`: what it
        waits for, for that warning)."""
        if self._early is not None:
            early, self._early = self._early, None
            return early
        sock = self._sock
        if sock is None:
            raise RuntimeError("PoolLoader(share_batches=...): this loader was closed")
        started = time.monotonic()
        warn_at = None if self._stall_warning is None else started + self._stall_warning
        while True:
            tick = 1.0 if warn_at is None else min(1.0, max(0.0, warn_at - time.monotonic()))
            if rendezvous.wait_readable(sock, tick):
                break
            if self._timeout and time.monotonic() - started > self._timeout:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds "
                                   f"(waiting for rank {self.leader}'s shared batch)")
            if warn_at is not None and time.monotonic() >= warn_at:
                warn_at = None  # once per stall: the next wait that stalls warns again
                self._warn_stall(time.monotonic() - started, what)
        try:
            with fork.creating():  # a fork from another thread never inherits these
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 1)
                for fd in fds:
                    fork.hold(fd)
        except OSError:
            data, fds = b"", []
        if not data:
            raise WorkerDied(f"PoolLoader(share_batches=...): rank {self.leader} (pid "
                             f"{self.leader_pid}), whose batches this rank {self.rank} shares, "
                             "exited or closed its loader")
        return pickle.loads(data), fds

    def _settle(self, wanted: tuple[int, int] | None) -> tuple | None:
        """The batch receive() returned last, if it is (epoch, n) `wanted` and was not
        decoded (an interrupt came between the two: the iterator asks for it again).
        Otherwise it is done with once decoded (its lease holds it), or, when another
        batch is `wanted`, lost with the interrupted next() (given back, as its holder);
        `wanted` None: kept until the next receive()."""
        handed = self._handed
        if handed is None:
            return None
        key = handed[3]
        if key in self.leases.values():  # decoded: until flush() takes the lease out
            self._handed = None
            return None
        if wanted is None or handed[:2] == wanted:
            return handed
        self._handed = None
        self._send_back(key)
        return None

    def _warn_stall(self, waited: float, what: str) -> None:
        warn(StallWarning(
            f"PoolLoader(share_batches=...): next() on rank {self.rank} has waited "
            f"{waited:.1f} s for {what} from rank {self.leader} (pid {self.leader_pid}), "
            "whose workers make the batches this rank shares, and goes on waiting "
            f"(timeout={self._timeout}; this warning: stall_warning={self._stall_warning}, "
            f"None turns it off). Rank {self.leader} may be stuck, or not iterating this "
            "loader: its own stall warning names the worker that owes a batch"), StallWarning)

    def finished(self, epoch: int) -> None:
        """This rank's sampler ran out in `epoch`: its leader need not count on it in
        that epoch any more (a later close is a normal end: ShareLeader._gone)."""
        self._tell(("finished", epoch))

    def _tell(self, message) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send(_pack(message), socket.MSG_DONTWAIT)
        except OSError:
            pass  # the leader is gone (the next receive says so), or its socket is full

    def receive(self, epoch: int, n: int, index, tracker):
        """(view, source, key) of this epoch's batch `n`, whose indices must be
        `index`: the view (this rank's private mapping of the slot) to decode it from,
        renewed for it, and the mapping to read its header and resume record from;
        `tracker` (the iterator's ResumeTracker) learns what the leader's learned. The
        caller decodes it (its lease in `leases`, keyed by `key`) or asks for the same
        (epoch, n) again; anything else gives it back."""
        handed = self._settle((epoch, n))
        if handed is None:
            handed = self._next_batch(epoch, n, tracker)
        _epoch, _n, have, key, theirs = handed
        if _by_value(theirs) != _by_value(index):
            self._handed = None
            self._send_back(key)
            raise ValueError(
                f"PoolLoader(share_batches=...): batch {n} of rank {self.leader} holds the "
                f"samples {_short(theirs)}, but this rank {self.rank}'s sampler gives "
                f"{_short(index)}: the ranks of a share_batches group must consume identical "
                "batches (the same sampler, seed and arguments: e.g. DistributedSampler("
                "num_replicas=, rank=) set to the group's data-parallel rank, not the "
                "global one)")
        _, view, shared = have
        try:
            if self.cuda is not None:
                self.cuda.register(view, key[1])  # the first batch in it only
            # this rank's batches in the view are gone (the leader reuses a slot only
            # once every rank dropped its batch), so its copied pages go: the view
            # shows the leader's workers' new batch (again, harmlessly, for a retry)
            source = shared if shared is not None else view
            renew(view, shared, fmt.DATA_OFF,
                  fmt.reply_end(fmt.header_view(source), view.size))
        except BaseException:
            self._handed = None
            self._send_back(key)
            raise
        return view, source, key

    def _next_batch(self, epoch: int, n: int, tracker) -> tuple:
        """Read the leader's messages up to this epoch's batch `n`; it is `_handed`."""
        while True:
            message, fds = self._recv(f"batch {n} of epoch {epoch}")
            kind = message[0]
            if kind == "seen" and message[1] <= epoch:
                # also an earlier epoch's: this rank read no batch since (each follows
                # its epoch's "seen" on the socket), so its state is where it was then
                tracker.learned(*message[2])
                continue
            if kind == "failed":
                raise RuntimeError(f"PoolLoader(share_batches=...): rank {self.leader}, whose "
                                   f"batches this rank shares, failed: {message[1]}")
            if kind == "batch":
                _, their_epoch, k, key, size, theirs = message
                pool_id, slot, generation = key
                if any(p != pool_id for p, _ in self._maps):  # the leader's older pools
                    for old in [k for k in self._maps if k[0] != pool_id]:
                        self._forget(old)
                if fds:
                    try:
                        view, shared = self._map(fds[0], size)
                    finally:
                        for fd in fds:
                            fork.release(fd)
                    self._forget((pool_id, slot))  # a segment the slot had before
                    self._maps[(pool_id, slot)] = (generation, view, shared)
                    self.segments_mapped += 1
                if their_epoch < epoch:  # an epoch this rank left early: not consumed
                    self._send_back(key)
                    continue
            else:  # "end", or a later epoch's "seen"
                their_epoch = message[1]
                if their_epoch < epoch:
                    continue
            if their_epoch > epoch or kind == "end":
                if their_epoch > epoch:
                    self._early = (message, [])
                raise RuntimeError(
                    f"PoolLoader(share_batches=...): rank {self.leader} ended its epoch after "
                    f"{n} batches, and this rank {self.rank}'s sampler has more: the ranks of a "
                    "group must have samplers that give the same batches (same seed, "
                    "num_replicas and rank arguments)")
            have = self._maps.get((pool_id, slot))
            if have is None or have[0] != generation or k != n:
                raise RuntimeError(f"internal error: rank {self.rank} got batch {k} (slot {slot}, "
                                   f"generation {generation}) from rank {self.leader}, "
                                   f"expecting batch {n}")
            self._handed = (epoch, n, have, key, theirs)
            return self._handed

    def _map(self, fd: int, size: int) -> tuple[Mapping, Mapping | None]:
        """(this rank's private view of the leader's segment `fd`, the segment's shared
        mapping, only when the view is to be registered with CUDA: then the view's
        pages are made this rank's own before it is registered, and each batch is
        copied in from the shared one; docs/node.md, share_batches, "On CUDA"). Both
        MADV_DONTFORK, as the leader's (poolloader.shm.fork)."""
        view = Mapping(fd, size, True, True)
        if self.cuda is None or self.cuda.gate is None:
            return view, None
        shared = Mapping(fd, size, True)
        view.pull(shared, 0, size)
        return view, shared

    def _forget(self, where: tuple[int, int]) -> None:
        """Drop the mapping of (pool id, slot): its batches still view it; on CUDA it is
        unregistered once copies from it finished."""
        have = self._maps.pop(where, None)
        if have is not None and self.cuda is not None:
            self.cuda.drop(have[1])

    def _send_back(self, key) -> None:
        try:
            self._sock.send(_pack(("released", [(key, False)])))  # type: ignore[union-attr]
        except OSError:
            pass

    def close(self) -> None:
        """Also from a finaliser (the loader collected, or the process exiting): says
        goodbye first, so the leader knows this is no death."""
        self._tell(("bye",))
        sock, self._sock = self._sock, None
        self._handed = None  # the socket's close gives back what this rank held
        rendezvous.close_socket(sock)
        cuda, self.cuda = self.cuda, None
        if cuda is not None:
            cuda.close()  # maybe from a finaliser: no CUDA call (FollowerCuda.close)
        self._maps = {}


def _by_value(index):
    """A batch sampler's batch (a list or tuple, of ints or 0-d tensors; an index tensor; a
    numpy array) as nested lists of Python values, so two ranks' batches compare by value
    (`!=` of tensors or arrays is elementwise, and its truth value ambiguous)."""
    if isinstance(index, (list, tuple)):
        return [_by_value(i) for i in index]
    tolist = getattr(index, "tolist", None)
    return tolist() if callable(tolist) else index


def _short(index) -> str:
    text = repr(index)
    return text if len(text) <= 120 else text[:117] + "..."


class FollowerIter(_BaseDataLoaderIter):
    """A follower's iterator: its own sampler's batches, decoded from its leader's slots.

    It keeps its own resume state (poolloader.resume.tracker), fed with the records the
    leader's workers wrote into the same slots: its `state_dict()` is the leader's at the
    same step, and a loaded one positions its sampler where the leader resumes."""

    def __init__(self, loader, link: ShareFollower, resume_plan=None) -> None:
        self._link = link  # the loader's side of its group (join)
        link.acquire()  # the loader may go before this iterator
        weakref.finalize(self, link.release)
        super().__init__(loader)
        setup = IteratorSetup(self._num_workers, self._base_seed, True, self._persistent_workers,
                              self._dataset_kind, self._index_sampler, self._shared_seed,
                              self._IterableDataset_len_called)
        self._resume = ResumeTracker(setup, loader, resume_plan)
        self._base_seed = self._resume.base_seed
        self._stateful = loader.stateful
        # pinning or device= copies as an ordinary iterator's, with the link's gate
        cuda = link.cuda_side(loader, self._pin_memory, getattr(self, "_pin_memory_device", None))
        self._stager = cuda.stager
        self._small_buffer = cuda.gate.small_buffer if cuda.gate is not None else None
        if self._stager is not None:
            self._stager.reset()  # an earlier iterator's staged batch: given back
        self._reset(loader, first_iter=True)

    @property
    def resume_tracker(self) -> ResumeTracker:
        return self._resume

    def _reset(self, loader, first_iter=False) -> None:
        self._resume.begin_epoch()  # before the sampler's iterator draws anything
        super()._reset(loader, first_iter)
        if not first_iter and self._stager is not None:
            self._stager.reset()  # a staged batch's slot cools behind its copy event
        self._epoch = self._link.begin_epoch()
        self._n = 0
        # the indices drawn for batch self._n whose receive() raised (an interrupt or
        # timeout= while waiting, before its message was read): a retry waits for it again
        self._drawn: object | None = None
        resumed = self._resume.position_epoch(self._sampler_iter, first_iter)
        if resumed is not None:
            self._sampler_iter = resumed.sampler_iter
            self._num_yielded = resumed.yielded

    def __next__(self):
        try:
            data = super().__next__()
        except StopIteration:
            self._resume.finish()
            self._link.finished(self._epoch)
            raise
        except BaseException:
            self._resume.raised(staged=self._stager is not None)
            raise
        self._resume.commit()
        return data

    def _next_data(self):
        if self._stager is None:
            return self._next_host()
        return self._stager.next(self._next_host)  # pinning, or device= one batch ahead

    def _next_host(self):
        link = self._link
        link.flush()
        n = self._n
        if self._drawn is not None:
            index = self._drawn  # as DataLoader's retry waits for the same batch
        else:
            # in order, so the leader's batch n answers its request n, as here
            index = self._resume.next_index(self._sampler_iter, n)  # StopIteration: epoch over
            self._drawn = index
        view, source, key = link.receive(self._epoch, n, index, self._resume)
        self._drawn = None
        self._n += 1
        header = fmt.header_view(source)
        record = (fmt.reply_state(source, header) or None) if self._stateful else None
        self._resume.received(int(header[fmt.F_WORKER]), n, record, fmt.reply_is_error(header))
        payload, lease = codec.decode(view, header, link.leases, link.on_release, key,
                                      small_buffer=self._small_buffer)
        del lease
        if fmt.reply_is_error(header):
            payload.reraise()
        return payload

    def _shutdown_workers(self) -> None:
        """Nothing to stop: the leader's workers make this rank's batches."""
        self._link.flush()


def join(loader, share_batches) -> ShareLeader | ShareFollower | None:
    """This loader's side of its share_batches group on this node (None: it shares
    nothing here); the group's loaders meet where they are built in the program
    (poolloader.main.rendezvous); closed when the loader is collected."""
    found = plan(members(share_batches))
    if found is None:
        return None
    check(loader)
    os.environ[rendezvous.RANK_PID_ENV] = str(os.getpid())  # its children are not ranks
    leader, rank, followers, run_key = found
    here = "-".join(map(str, (leader, *followers)))  # [0, 1] and [0, 2] do not meet
    address = rendezvous.address(run_key, rendezvous.place(f"share/{here}",
                                                           rendezvous.build_site()))
    timeout = rendezvous.rendezvous_timeout()
    side: ShareLeader | ShareFollower
    if rank == leader:
        what = f"PoolLoader(share_batches=...) on rank {rank}"
        listener = rendezvous.listen(address, socket.SOCK_SEQPACKET, what)
        if listener is None:
            rendezvous.close_socket(rendezvous.connect(address, socket.SOCK_SEQPACKET, what))
            raise RuntimeError(f"{what}: another process of this job listens for this loader's "
                               "followers (internal error: a place built twice)")
        side = ShareLeader(loader, listener, rank, followers, timeout)
    else:
        side = ShareFollower(loader, address, leader, rank, timeout)
    side.acquire()
    weakref.finalize(loader, side.release)
    return side
