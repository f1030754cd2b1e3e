"""A share_batches group's follower (poolloader.main.share): connected to its leader,
maps the leader's segments (a private view each: each rank's batch is its own) and
takes each batch its leader publishes, checked against its own sampler's indices."""
from __future__ import annotations

import collections
import socket
import time

from poolloader.cuda import gate
from poolloader.errors import StallWarning, WorkerDied, warn
from poolloader.main import rendezvous
from poolloader.main.share_cuda import FollowerCuda
from poolloader.main.share_leader import fingerprint
from poolloader.shm import fork
from poolloader.shm._shm import Mapping
from poolloader.shm.pool import renew
from poolloader.wire import slot_format as fmt


class Unshared(Exception):
    """This rank's loader shares nothing: its leader built no loader at the same place
    within the wait, or began its first batch without it. The loader loads its own
    batches (poolloader.main.share.join); the message says why."""

    def __init__(self, message: str, late: bool):
        super().__init__(message)
        self.late = late  # the leader came, after its group was made


class ShareFollower(rendezvous.Users):
    """A follower's side: connected to its leader; maps the leader's segments. Open
    while its loader or one of its iterators lives (rendezvous.Users)."""

    role = "follower"

    def __init__(self, loader, address: bytes, leader: int, rank: int, wait: float):
        """Joins the leader listening at `address`, waiting up to `wait` s for it; Unshared
        if it does not come, or its group was made without this rank."""
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
        deadline = time.monotonic() + wait
        what = f"PoolLoader(share_batches=...) on rank {rank}"
        own = ("it loads its own batches, as DataLoader would, so they are the leader's "
               "only where the group's ranks draw the same ones")
        while True:
            sock = rendezvous.connect(address, what)
            if sock is not None:
                break
            if time.monotonic() >= deadline:
                raise Unshared(
                    f"PoolLoader(share_batches=...): rank {rank} found no loader of its "
                    f"leader, rank {leader}, built at the same place in the program within "
                    f"{wait:g} s, and shares nothing: {own} ({rendezvous.SHARE_WAIT_ENV} "
                    "sets the wait)", late=False)
            time.sleep(rendezvous.CONNECT_RETRY_S)
        self._sock = sock
        try:
            self.leader_pid = rendezvous.peer(sock)[0]
            sock.settimeout(rendezvous.rendezvous_timeout())  # the leader answers at once
            rendezvous.send(sock, {"fingerprint": fingerprint(loader), "rank": rank})
            try:
                answer = rendezvous.recv(sock)
            except OSError as e:
                why = "it closed the connection" if type(e) is ConnectionError else \
                    f"{type(e).__name__}: {e}"
                raise RuntimeError(f"PoolLoader(share_batches=...): rank {rank} reached its "
                                   f"leader, rank {leader} (pid {self.leader_pid}), which did "
                                   f"not take it in: {why}") from None
            if answer[0] == "late":
                raise Unshared(
                    f"PoolLoader(share_batches=...): rank {rank} built this loader after its "
                    f"leader, rank {leader} (pid {self.leader_pid}), had begun its first batch "
                    f"(it waits {rendezvous.share_wait():g} s for the group from its first "
                    f"iter(); {rendezvous.SHARE_WAIT_ENV} sets that), and shares nothing: "
                    f"{own}. Build the group's loaders before any of them iterates", late=True)
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
                rendezvous.send(self._sock, ("released", keys))
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
            return rendezvous.receive(sock, wait=False)  # poll said it is there
        except OSError as e:
            why = "" if type(e) is ConnectionError else f" ({type(e).__name__}: {e})"
        raise WorkerDied(f"PoolLoader(share_batches=...): rank {self.leader} (pid "
                         f"{self.leader_pid}), whose batches this rank {self.rank} shares, "
                         f"exited or closed its loader{why}")

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
            rendezvous.send(self._sock, message, wait=False)
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
            rendezvous.send(self._sock, ("released", [(key, False)]))  # type: ignore[arg-type]
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


