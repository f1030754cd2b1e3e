"""A share_batches group's leader (poolloader.main.share): listens for its followers and
publishes each slot it delivers to them (messages and descriptors:
poolloader.main.rendezvous's one protocol); what their loaders must agree on
(`fingerprint`)."""
from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from typing import Any

from poolloader.errors import warn
from poolloader.main import node, rendezvous
from poolloader.shm import fork

# How long the leader's send to a follower may wait for room (a follower that stopped
# taking its batches while the leader went on for thousands): then an error.
SEND_TIMEOUT_S = 30


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


class ShareLeader(rendezvous.Users):
    """The leader's side: listens for its followers, publishes each delivered slot.
    Open while its loader or one of its iterators lives (rendezvous.Users)."""

    role = "leader"

    def __init__(self, loader, listener: socket.socket, rank: int, followers: list[int],
                 wait: float, awaited: list[int], on_missed):
        """`followers`: the group's other ranks here; its first batch waits up to `wait`
        s (from its first iter()) for those of them `awaited`, then the group is who
        came, for the loader's life, and `on_missed` learns the ranks that did not."""
        self.rank = rank
        self.expected = list(followers)
        self._mine = fingerprint(loader)
        self._wait = wait
        self.awaited = set(awaited)  # the followers its first batch waits for
        self._on_missed = on_missed
        self._open = True  # followers may still join: until the first batch is published
        self._deadline: float | None = None  # of that wait, set by the first begin_epoch
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
        except BaseException as e:  # told by _make_group, at once
            self._failed = e

    def _accept_followers(self) -> None:
        listener = self._listener
        while not self._closed:  # also after the group is made: a late rank hears so
            if not rendezvous.wait_readable(listener, 0.25):
                continue
            if self._closed:
                return
            conn = rendezvous.accept(listener)
            if conn is None:
                continue
            try:
                conn.settimeout(30.0)
                hello = rendezvous.recv(conn)
                theirs, rank = hello["fingerprint"], hello["rank"]
                difference = rendezvous.first_difference(theirs, self._mine, f"rank {self.rank}")
                if rank not in self.expected or any(f.rank == rank for f in self._followers):
                    difference = f"rank {rank} is not an expected follower {self.expected}"
                if difference is not None:
                    # the follower's words are its own ("here": its value)
                    mine = rendezvous.first_difference(self._mine, theirs, f"rank {rank}")
                    self._refused.append(f"rank {rank}: {mine or difference}")
                    rendezvous.send(conn, ("refused", difference))
                    rendezvous.close_socket(conn)
                    continue
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                with self._lock:  # the group is made under it (_make_group)
                    if self._closed:
                        raise ConnectionError("closed meanwhile")
                    if not self._open:  # this rank's first batch went without it
                        rendezvous.send(conn, ("late",))
                        rendezvous.close_socket(conn)
                        continue
                    # welcomed before it is listed: a batch or an end is sent only to a
                    # listed follower, so it never comes before the welcome
                    rendezvous.send(conn, ("welcome",))
                    # blocking, but a send gives up after SEND_TIMEOUT_S (BlockingIOError),
                    # and collect()'s receives never wait (MSG_DONTWAIT)
                    conn.settimeout(None)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                    struct.pack("ll", SEND_TIMEOUT_S, 0))
                    self._followers.append(_Follower(conn, rank, rendezvous.peer(conn)[0]))
            except Exception:
                rendezvous.close_socket(conn)  # that follower gave up or sent nonsense

    def _make_group(self) -> None:
        """Before the first batch is published: wait for the awaited followers until
        they all came or the wait is over (a loader only some ranks build: an
        evaluation on this rank alone), then close the group to later ones (they load
        their own batches: ShareFollower, "late")."""
        deadline = self._deadline if self._deadline is not None else time.monotonic()
        while True:
            if self._failed is not None:
                raise RuntimeError(f"PoolLoader(share_batches=...): rank {self.rank} stopped "
                                   f"accepting the ranks it shares batches with: "
                                   f"{type(self._failed).__name__}: {self._failed}") \
                    from self._failed
            if self._refused:
                raise ValueError(f"PoolLoader(share_batches=...): rank {self.rank} refused a "
                                 f"rank of its group whose loader differs: "
                                 f"{'; '.join(self._refused)}")
            came = {f.rank for f in self._followers}
            if self.awaited <= came or time.monotonic() > deadline \
                    or not self._thread.is_alive():
                break
            time.sleep(0.005)
        with self._lock:
            self._open = False
            came = {f.rank for f in self._followers}
        self._on_missed(set(self.expected) - came)

    # -- per epoch and per batch ---------------------------------------------------------
    def begin_epoch(self, ledger) -> int:
        """A new epoch of the leader's iterator whose slots are `ledger`'s."""
        if ledger is not self.ledger:  # a new pool: slot numbers start again
            self.ledger = ledger
            self._pool_id += 1
            for f in self._followers:
                f.sent, f.held = {}, collections.Counter()
        if self._deadline is None:  # the followers' wait runs while workers start
            self._deadline = time.monotonic() + self._wait
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
        if self._open:
            self._make_group()
        self.collect()
        generation = pool.generations[slot]
        key = (self._pool_id, slot, generation)
        body = rendezvous.pack(("batch", self._epoch, self._n, key, pool.size(slot), index),
                               "PoolLoader(share_batches=...): a batch's sample indices")
        self._published, self._n = (epoch, seq), self._n + 1  # together: no call between
        for f in list(self._followers):
            fresh = f.sent.get(slot) != generation  # its first batch in this segment
            if not self._send(f, body, [pool.descriptor(slot)] if fresh else ()):
                continue
            if fresh:
                f.sent[slot] = generation
            f.held[key] += 1
            f.last_epoch = self._epoch
            self.ledger.share_out(slot, generation)

    def _send(self, f: _Follower, body: list[bytes], fds=()) -> bool:
        """Send `body` (rendezvous.pack's, with descriptors `fds`) to `f`: False if it is
        gone (dropped here); a follower that took nothing for SEND_TIMEOUT_S is an error."""
        try:
            rendezvous.send_packed(f.sock, body, fds)
        except BlockingIOError:
            raise self._stuck(f) from None
        except OSError:
            self._gone(f)
            return False
        return True

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
            try:
                body = rendezvous.pack(("seen", self._epoch, one), "a worker's resume record")
            except ValueError as e:
                if not self._warned_large:
                    self._warned_large = True
                    warn(f"PoolLoader(share_batches=...): {e}, so the followers' state_dict() "
                         "lacks a batch their leader's workers made and never delivered: it "
                         "resumes a follower exactly, not the rank that leads; keep the "
                         "dataset's state_dict() small or pass a larger snapshot_every_n_steps=")
                continue
            for f in list(self._followers):
                self._send(f, body)

    def fail(self, epoch: int, why: str) -> None:
        if epoch == self._epoch:
            self._broadcast(("failed", why))

    def _broadcast(self, message) -> None:
        body = rendezvous.pack(message)
        for f in list(self._followers):
            try:
                rendezvous.send_packed(f.sock, body)
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
                message, fds = rendezvous.receive(f.sock, wait=False)
            except BlockingIOError:
                return True
            except Exception:  # closed, or sent what cannot be read
                return False
            for fd in fds:  # a follower sends none
                fork.release(fd)
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


