"""The batch codec: encode a batch into a slot (worker side), decode it out (main side).

The layout and the header are slot_format's; this module fills the data region,
the small block and the skeleton, and rebuilds the batch from them (the module
docstring of slot_format.py describes what a decoded batch's tensors are).

What main trusts in what it reads from shared memory. The workers run as the same
user as main, running the user's own dataset code, as DataLoader's do (and
DataLoader's main unpickles whatever its workers send). So the slots are not a
security boundary: any process of that user can write them, and a skeleton is a
pickle, which may call any importable callable. What is checked is what a bug or a
crash can produce (a torn or stray write, a worker killed mid-publish, a dataset
that rewrites a slot tensor it kept): it becomes SlotCorrupt (ControlCorrupt for
the rings and control block) in main, never a read or write outside the slot, a
crash, a hang or an allocation sized by a corrupt field.

* checked: the header (magic, the batch number and worker echoed, status, every
  offset and length inside the slot: `slot_format.check_reply` and `reply_status`);
  the skeleton's CRC32 before pickle sees it (integrity, not authenticity); each
  persistent id (kind, dtype code, alignment; a view is bounded by the lease over
  the data region or by the private small buffer; a zero-element tensor must have
  a zero in its shape, so nothing is allocated from a claimed size); the request
  and resume record bounds; ring counters and capacity (poolloader.shm._ring).
* not checked: the values of tensor and array bytes (a worker that writes wrong
  numbers delivers them, as under DataLoader); what the unpickled skeleton builds
  besides tensors; a worker writing a slot after it returned it (invariant 1 is
  kept by the code on both sides, not by page protection).

So the property decode has, and the tests hold it to: corruption under the
checksum the writer computed never reaches pickle (no global is resolved); a
skeleton whose checksum matches is a worker's output and is unpickled whole, any
global it names included, as DataLoader unpickles its workers' sends. A forged
skeleton that calls `os.system` reaches it (tests/test_robustness.py,
test_forged_skeleton_is_trusted_only_under_its_own_checksum); restricting the
globals would refuse batches DataLoader carries (a pandas frame, a user's own
reduce function) and protect nothing, since any writer of the slot can already run
code as the user.
"""
from __future__ import annotations

import ctypes
import gc
import io
import pickle
import types
import zlib
from typing import Literal

import numpy as np
import torch

from poolloader.errors import SlotCorrupt
from poolloader.shm._shm import Lease, Mapping, take_lease
from poolloader.wire.slot_format import (
    DATA_OFF,
    DTYPE_CODE,
    DTYPES,
    ITEMSIZE,
    NUM_DTYPES,
    SMALL_BATCH_BYTES,
    SMALL_TENSOR_BYTES,
    NeedsGrow,
    align64,
    align_small,
    check_reply,
    claimed_data_len,
    publish_reply,
    span_elements,
)

# Persistent id kinds in a skeleton: a tensor or array in the data region, in the
# small block, or pickled whole.
PID_TENSOR, PID_ARRAY, PID_SMALL_TENSOR, PID_SMALL_ARRAY, PID_PICKLED = 1, 2, 3, 4, 5

# ---------------------------------------------------------------------------
# worker side: allocate in the slot, encode a payload

class SlotWriter:
    """Fills one slot's data region (worker side, one batch at a time).

    `empty()` hands out 64-byte-aligned tensors inside the slot, so a collate
    writes each byte once (None when the slot is full). `alloc()` keeps counting
    past the end, so a single NeedsGrow reports the whole size needed.

    `begin()` also notices a tensor that a dataset or collate kept from an earlier
    batch in the same slot (its storage is still in use): that memory is about to be
    rewritten, so it warns once, naming the fix.
    """

    def __init__(self):
        self.mapping = None
        self._cache = {}  # slot -> (mapping, u8 tensor, u8 array, storage uses alone)
        self.warned_kept = False

    def begin(self, mapping, slot: int = 0, check_kept: bool = True) -> None:
        self.mapping = mapping
        cached = self._cache.get(slot)
        if cached is None or cached[0] is not mapping:
            u8 = torch.from_numpy(np.frombuffer(mapping, np.uint8))
            cached = (mapping, u8, np.frombuffer(mapping, np.uint8), _storage_uses(u8))
            self._cache[slot] = cached  # drops the slot's previous generation
        elif check_kept and not self.warned_kept and _storage_uses(cached[1]) > cached[3]:
            self._warn_kept()
        self.u8 = cached[1]
        self.np_u8 = cached[2]
        self.address = mapping.address
        self.limit = mapping.size
        self.cursor = DATA_OFF

    def _warn_kept(self) -> None:
        import warnings
        self.warned_kept = True
        warnings.warn(
            "PoolLoader worker: a tensor made by the dataset or collate_fn inside a slot "
            "(slot_empty or the default collate) is still alive after its batch was sent, "
            "and the slot is being reused: that tensor's values will change. Keep a copy "
            "instead (tensor.clone()).", RuntimeWarning, stacklevel=3)

    def end(self) -> None:
        # keep no view of the mapping between batches: main may detach or replace it
        self.mapping = None
        self.u8 = self.np_u8 = None

    def forget_stale(self, current: set[int]) -> None:
        """Drop the cached views of every mapping whose id is not in `current` (the
        worker's live slot mappings after a sync), so a replaced or detached segment
        is unmapped here as soon as nothing else views it."""
        for slot, cached in list(self._cache.items()):
            if id(cached[0]) not in current:
                del self._cache[slot]

    def alloc(self, nbytes: int) -> int | None:
        off = align64(self.cursor)
        self.cursor = off + nbytes
        return off if self.cursor <= self.limit else None

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        if dtype not in DTYPE_CODE:
            return None
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * ITEMSIZE[DTYPE_CODE[dtype]]
        cursor = self.cursor
        off = self.alloc(nbytes)
        if off is None:
            # the caller allocates elsewhere and the encoder counts the copy then
            self.cursor = cursor
            return None
        return self.u8[off:off + nbytes].view(dtype).view(shape)

    def locate(self, t: torch.Tensor, nbytes: int) -> int | None:
        """Byte offset of `t`'s first element if its whole span already lies in this slot."""
        if self.mapping is None or t.untyped_storage().data_ptr() != self.address:
            return None
        off = t.data_ptr() - self.address
        if DATA_OFF <= off and off + nbytes <= min(self.cursor, self.limit):
            return off
        return None


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share `t`'s storage right now."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_STRIDED = torch.strided


def _plain_tensor(t: torch.Tensor) -> bool:
    # one call per tensor of the batch: no t.device (it builds an object each time)
    return (t.layout is _STRIDED and t.is_cpu and not t.is_nested
            and not (t.requires_grad or t.is_conj() or t.is_neg()))


# What pickle carries with its own opcodes, naming no global.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes, bytearray, tuple, list,
                          dict, set, frozenset})
# Batch types, and the functions their pickling names, whose rebuild makes no tensor of
# its own (poolloader.detection registers PackedTargets): see VIEWS_UNTRACKED.
_UNTRACKED_TYPES: set = set()
_UNTRACKED_FUNCTIONS: set = set()


def allow_untracked(batch_type: type, *functions) -> None:
    """Let skeletons holding `batch_type` (pickled by naming `functions`) keep
    VIEWS_UNTRACKED: its rebuild must make no tensor and call nothing of the user's."""
    _UNTRACKED_TYPES.add(batch_type)
    _UNTRACKED_FUNCTIONS.update(functions)


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file, writer: SlotWriter):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer = writer
        self.memo_ids: dict = {}
        self.keep: list = []
        self.small: list = []  # (tensor or array, nbytes, offset in the small block)
        self.small_len = 0
        self.names_globals = False  # pickled an object that names a global (VIEWS_UNTRACKED)
        self.repeated = False  # holds one tensor or array in two places (TENSOR_REPEATED)
        self.tensors = False  # made a tensor's pid: VIEWS_UNTRACKED matters only then

    def persistent_id(self, obj):
        # called by pickle for every object it saves (the ids themselves excepted)
        kind = type(obj)
        if kind is torch.Tensor or kind is np.ndarray:
            pid = self.memo_ids.get(id(obj))
            if pid is not None:  # the same pid tuple: one object in main (_Repeated)
                self.repeated = True
                return pid
            pid = self._tensor(obj) if kind is torch.Tensor else self._array(obj)
            if pid is None:  # pickled by torch's or numpy's reducers (and pickle's memo)
                self.names_globals = True
                return None
            if pid[0] == PID_PICKLED:
                self.names_globals = True
            elif kind is torch.Tensor:
                self.tensors = True
            self.memo_ids[id(obj)] = pid
            self.keep.append(obj)  # alive until the dump ends: its id is not reused
            return pid
        if not (self.names_globals or kind in _PLAIN_TYPES or kind in _UNTRACKED_TYPES
                or (kind is types.FunctionType and obj in _UNTRACKED_FUNCTIONS)):
            self.names_globals = True
        return None

    def _small(self, nbytes: int) -> int | None:
        if nbytes > SMALL_TENSOR_BYTES or self.small_len + nbytes > SMALL_BATCH_BYTES:
            return None
        off = align_small(self.small_len)
        self.small_len = off + nbytes
        return off

    def _tensor(self, t: torch.Tensor):
        if t.is_nested:
            # torch rebuilds a nested tensor from its buffer's storage start, ignoring a
            # view's offset: carry it whole, pickled as DataLoader's pickling would
            return (PID_PICKLED, pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
        code = DTYPE_CODE.get(t.dtype)
        if code is None or not _plain_tensor(t):
            return None
        shape, stride = tuple(t.shape), t.stride()
        count = t.numel() if t.is_contiguous() else span_elements(shape, stride)
        nbytes = count * ITEMSIZE[code]
        small = self._small(nbytes)
        if small is not None:
            self.small.append((t, nbytes, small))
            return (PID_SMALL_TENSOR, code, small, shape, stride)
        w = self.writer
        off = w.locate(t, nbytes)
        if off is None:
            off = w.alloc(nbytes)
            if off is None:
                off = DATA_OFF  # overflow: keep counting, NeedsGrow follows
            elif nbytes:
                w.u8[off:off + nbytes].view(t.dtype).copy_(_span(t, count))
        return (PID_TENSOR, code, off, shape, stride, count)

    def _array(self, a: np.ndarray):
        if a.dtype.hasobject or a.dtype.fields is not None:
            return None
        order = _order(a)
        small = self._small(a.nbytes)
        if small is not None:
            self.small.append((a, a.nbytes, small))
            return (PID_SMALL_ARRAY, a.dtype.str, small, a.shape, order)
        w = self.writer
        off = w.alloc(a.nbytes)
        if off is None:
            off = DATA_OFF
        elif a.nbytes:
            np.ndarray(a.shape, a.dtype, buffer=w.np_u8, offset=off, order=order)[...] = a
        return (PID_ARRAY, a.dtype.str, off, a.shape, order)

    def write_small(self, small_off: int) -> None:
        w = self.writer
        for obj, nbytes, rel in self.small:
            if not nbytes:
                continue
            off = small_off + rel
            if type(obj) is np.ndarray:
                order = _order(obj)
                np.ndarray(obj.shape, obj.dtype, buffer=w.np_u8, offset=off, order=order)[...] = obj
            else:
                # a strided CPU tensor's span is one run of memory from its first element
                # (_span): one memmove, not a slice, a view and a copy_ per small tensor
                ctypes.memmove(w.address + off, obj.data_ptr(), nbytes)


def _order(a: np.ndarray) -> Literal["C", "F"]:
    """How an array's bytes are laid out in the slot: Fortran order only when it is that alone."""
    return "F" if (a.flags.f_contiguous and not a.flags.c_contiguous) else "C"


def _span(t: torch.Tensor, count: int) -> torch.Tensor:
    """The 1-D run of storage elements a strided tensor covers, from its first one."""
    return torch.as_strided(t, (count,), (1,), t.storage_offset())


def encode(writer: SlotWriter, header: np.ndarray, payload, status: int) -> None:
    """Write `payload` into the slot `writer` has begun and fill the header.

    Raises NeedsGrow (header untouched) when it does not fit, and whatever pickling
    raises for an object that cannot be carried at all.
    """
    buf = io.BytesIO()
    pickler = _SkeletonPickler(buf, writer)
    pickler.dump(payload)
    # a skeleton without a tensor view is unpickled as it is: no guard, no collector pause
    untracked = pickler.tensors and not pickler.names_globals
    flags = (VIEWS_UNTRACKED if untracked else 0) | (TENSOR_REPEATED if pickler.repeated else 0)
    if flags:
        buf.write(bytes((flags,)))
    skeleton = buf.getbuffer()
    small_off = align64(writer.cursor)
    small_len = align64(pickler.small_len)
    skel_off = small_off + small_len
    needed = skel_off + len(skeleton)
    if needed > writer.limit:
        raise NeedsGrow(needed)
    pickler.write_small(small_off)
    writer.np_u8[skel_off:needed] = np.frombuffer(skeleton, np.uint8)
    publish_reply(header, small_off, small_len, skel_off, len(skeleton), zlib.crc32(skeleton),
                  status)


# ---------------------------------------------------------------------------
# main side: decode

def _rebuild_sparse_checked(layout, data):
    """torch._utils._rebuild_sparse_tensor, validated at once.

    torch's version defers validation to a module-level list that only
    torch.load drains: under this unpickler the list would keep every sparse
    tensor alive forever. Check always.
    """
    if layout == torch.sparse_coo:
        indices, values, size, *rest = data
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=True,
                                       is_coalesced=rest[0] if rest else None)
    compressed_indices, plain_indices, values, size = data
    return torch.sparse_compressed_tensor(compressed_indices, plain_indices, values, size,
                                          layout=layout, check_invariants=True)


# The only global the unpicklers below resolve otherwise than pickle does. Its name is
# in a pickle's bytes wherever the pickle names it (GLOBAL and STACK_GLOBAL take the
# names as literal strings), so a pickle without these bytes is unpickled by pickle's
# own C find_class, without a Python call per global.
_SPARSE_REBUILD = b"_rebuild_sparse_tensor"


def _checked_find_class(unpickler: pickle.Unpickler, module, name):
    if name == "_rebuild_sparse_tensor" and module == "torch._utils":
        return _rebuild_sparse_checked
    return pickle.Unpickler.find_class(unpickler, module, name)


# A skeleton's flags: one byte after pickle's STOP, written when any is set (a pickle
# ends with STOP, b".", so a skeleton without flags ends with that byte, 0x2e).
#
# VIEWS_UNTRACKED: the skeleton holds a tensor view and its pickling named no global
# (save those of allow_untracked): main makes its tensors below autograd's view
# tracking (torch's ADInplaceOrView dispatch key), as torch.load and DataLoader's main
# make theirs with set_(): none is a view of another (`_base` is None) and each has a version counter
# of its own, so an in-place write into one field (another small tensor of the same
# dtype) does not fail autograd's check of a field it saved for backward. It costs
# less than a tracked view, too. A skeleton that names any other global (a user's
# reduce function may compute with tensors) is unpickled with autograd whole, its
# tensors views.
#
# TENSOR_REPEATED: the batch holds one tensor (or array) in two places (_Repeated).
VIEWS_UNTRACKED = 0x01
TENSOR_REPEATED = 0x02
_FLAGS_END = 0x04


def skeleton_flags(skeleton) -> int:
    """The flags byte after a skeleton's STOP; 0 when it has none."""
    flags = skeleton[-1] if len(skeleton) else 0
    return flags if flags < _FLAGS_END else 0


# torch's guard for the dispatch key (C++ at::AutoDispatchBelowADInplaceOrView); a
# torch without it gets tracked views, as a skeleton that names a global does
_BELOW_VIEW_TRACKING = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)


def _load_untracked(unpickler: pickle.Unpickler, below_view_tracking):
    """unpickler.load() below view tracking, with only our own Python inside it: the
    cyclic collector, which would run other objects' finalisers there, is held off
    for the load (the guard is the thread's own; other threads keep tracking). A
    Python signal handler may still run inside (at a persistent_load call); only a
    handler that makes views of tensors would see the difference. The collector's
    switch is the process's: a decode in another thread at the same time may turn it
    back on before this load ends, and another thread's gc.disable() during the load
    is undone at its end (microseconds)."""
    collecting = gc.isenabled()
    try:  # an interrupt right after disable() still reaches the finally
        if collecting:
            gc.disable()
        with below_view_tracking():
            return unpickler.load()
    finally:
        if collecting:
            gc.enable()


class _FallbackUnpickler(pickle.Unpickler):
    find_class = _checked_find_class


def _fallback_loads(blob: bytes):
    """A tensor pickled whole (PID_PICKLED), with sparse tensors checked."""
    if _SPARSE_REBUILD in blob:
        return _FallbackUnpickler(io.BytesIO(blob)).load()
    return pickle.loads(blob)


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickles a skeleton's structure; its persistent ids become views of the slot's
    data region (the lease) and of the private small block. Resolves globals as pickle
    does: a skeleton that names torch's sparse rebuild gets _SparseSkeletonUnpickler."""

    # one per batch: slots, not an instance dict
    __slots__ = ("lease", "made", "small", "small_buffer", "small_typed", "views")

    def __init__(self, file, lease: Lease, small: torch.Tensor | None, small_buffer=None):
        pickle.Unpickler.__init__(self, file)
        self.lease = lease        # the batch's bytes of the data region [DATA_OFF, data end)
        self.small = small        # private copy of the small block (uint8), or None
        self.small_buffer = small_buffer  # allocates it (page-locked with pin_memory), or None
        self.small_typed = [None] * NUM_DTYPES
        self.views = 0

    def _small_block(self) -> torch.Tensor:
        # A batch whose small tensors are all empty has a small block of 0 bytes, and
        # none is copied: its empty tensors get an empty private buffer of their own.
        if self.small is None:
            self.small = (torch.empty(0, dtype=torch.uint8) if self.small_buffer is None
                          else self.small_buffer(0))
        return self.small

    def persistent_load(self, pid):
        # Hot path: one call per tensor of the batch, so it checks only what torch
        # does not: kinds, dtype codes and alignment. torch.frombuffer rejects a
        # range outside the lease and as_strided any view past the end of its
        # storage, so no tensor can reach outside the slot's data region (or the
        # small buffer).
        try:
            kind = pid[0]
            if kind == PID_SMALL_TENSOR:
                _, code, off, shape, stride = pid
                if 0 <= code < NUM_DTYPES and not off % ITEMSIZE[code]:
                    typed = self.small_typed[code]
                    if typed is None:
                        typed = self.small_typed[code] = self._small_block().view(DTYPES[code])
                    return typed.as_strided(shape, stride, off // ITEMSIZE[code])
            elif kind == PID_TENSOR:
                _, code, off, shape, stride, count = pid
                if 0 <= code < NUM_DTYPES and off >= DATA_OFF and not off % ITEMSIZE[code]:
                    if count == 0:
                        # nothing in the slot bounds this tensor: only a shape of zero
                        # elements is taken (a corrupt one must not size an allocation)
                        if type(shape) is not tuple or 0 not in shape:
                            raise SlotCorrupt(f"persistent id {pid!r} claims 0 elements for "
                                              f"a shape of more")
                        return torch.empty_strided(shape, stride, dtype=DTYPES[code])
                    own = torch.frombuffer(self.lease, dtype=DTYPES[code], count=count,
                                           offset=off - DATA_OFF)
                    self.views += 1
                    return own.as_strided(shape, stride, 0)
            elif kind == PID_ARRAY:
                _, dtype_str, off, shape, order = pid
                self.views += 1
                return self._array(self.lease, DATA_OFF, dtype_str, off, shape, order)
            elif kind == PID_SMALL_ARRAY:
                _, dtype_str, off, shape, order = pid
                return self._array(self._small_block().numpy(), 0, dtype_str, off, shape, order)
            elif kind == PID_PICKLED:
                _, blob = pid
                if type(blob) is bytes:
                    return _fallback_loads(blob)
        except SlotCorrupt:
            raise
        except (TypeError, ValueError, IndexError, RuntimeError, OverflowError) as e:
            raise SlotCorrupt(f"persistent id {pid!r} does not describe a view inside the "
                              f"slot's data region or small block: {e}") from None
        raise SlotCorrupt(f"malformed persistent id {pid!r}")

    @staticmethod
    def _array(buffer, base: int, dtype_str, off, shape, order):
        # numpy's own checks bound the view's end (a buffer too small, a negative
        # dimension, non-integer shapes); it accepts a negative offset, so the
        # start is checked here.
        dtype = np.dtype(dtype_str)
        if (dtype.hasobject or order not in ("C", "F") or type(shape) is not tuple
                or type(off) is not int or off < base):
            raise SlotCorrupt(f"invalid array dtype {dtype_str!r}, order {order!r} or shape {shape!r}")
        return np.ndarray(shape, dtype, buffer=buffer, offset=off - base, order=order)


class _SparseSkeletonUnpickler(_SkeletonUnpickler):
    __slots__ = ()
    find_class = _checked_find_class


class _Repeated:
    """For a skeleton flagged TENSOR_REPEATED: a tensor (or array) the batch holds in
    two places is one object, as DataLoader's (for a tensor, one version counter:
    autograd sees an in-place write through either). The worker's pickler gives such
    an object one pid tuple, which pickle saves once and fetches from its memo after,
    so every place loads the same tuple object (alive in the unpickler's memo, and in
    `made`, for the load)."""

    __slots__ = ()

    def __init__(self, *args):
        _SkeletonUnpickler.__init__(self, *args)
        self.made = {}

    def persistent_load(self, pid):
        made = self.made.get(id(pid))
        if made is None:
            made = self.made[id(pid)] = (pid, _SkeletonUnpickler.persistent_load(self, pid))
        return made[1]


class _RepeatedSkeletonUnpickler(_Repeated, _SkeletonUnpickler):
    __slots__ = ()


class _RepeatedSparseSkeletonUnpickler(_Repeated, _SparseSkeletonUnpickler):
    __slots__ = ()


# (names torch's sparse rebuild, TENSOR_REPEATED) -> the skeleton's unpickler
_UNPICKLERS = {(False, False): _SkeletonUnpickler, (True, False): _SparseSkeletonUnpickler,
               (False, True): _RepeatedSkeletonUnpickler,
               (True, True): _RepeatedSparseSkeletonUnpickler}


def copy_small(mapping, small_off: int, small_len: int, small_buffer=None) -> torch.Tensor:
    """The batch's private copy of its small block: one allocation, one copy."""
    small = (torch.empty(small_len, dtype=torch.uint8) if small_buffer is None
             else small_buffer(small_len))
    if type(mapping) is Mapping:
        # one C call; the caller's lease exports `mapping`, so it stays mapped, and
        # check_reply bounded [small_off, small_off + small_len) by its size
        ctypes.memmove(small.data_ptr(), mapping.address + small_off, small_len)
    else:
        small.numpy()[:] = np.frombuffer(mapping, np.uint8, count=small_len, offset=small_off)
    return small


def decode(mapping, header: np.ndarray, registry: dict | None = None, on_release=None,
           key=None, small_buffer=None):
    """Rebuild the payload of a published slot.

    Returns (payload, lease). The lease covers the data region; it is created first
    thing and, with `registry`/`on_release`, registered in C (`take_lease`), so from
    then on the slot belongs to the lease: its death, whenever the last tensor of the
    batch in the slot dies (right away if none), hands `key` back through
    `on_release`. `lease` is None when the payload holds nothing in the slot.
    """
    # the lease first, over whatever the header claims (clamped to the slot), so a
    # corrupt header below is an error whose lease still gives the slot back
    claimed = claimed_data_len(header, mapping.size)
    if registry is not None:
        lease = take_lease(mapping, DATA_OFF, claimed, registry, on_release, key)
    else:
        lease = Lease(mapping, DATA_OFF, claimed)
    _data_len, small_off, small_len, skel_off, skel_len, expected = check_reply(header, mapping.size)
    skeleton = bytes(memoryview(mapping)[skel_off:skel_off + skel_len])
    crc = zlib.crc32(skeleton)
    if crc != expected:
        raise SlotCorrupt(f"slot skeleton checksum {crc:#010x} does not match the header's "
                          f"{expected:#010x} ({skel_len} bytes at {skel_off})")
    small = copy_small(mapping, small_off, small_len, small_buffer) if small_len else None
    flags = skeleton_flags(skeleton)
    unpickler = _UNPICKLERS[_SPARSE_REBUILD in skeleton, bool(flags & TENSOR_REPEATED)](
        io.BytesIO(skeleton), lease, small, small_buffer)
    try:
        below = _BELOW_VIEW_TRACKING
        if flags & VIEWS_UNTRACKED and below is not None:
            payload = _load_untracked(unpickler, below)
        else:
            payload = unpickler.load()
    except SlotCorrupt:
        raise
    except Exception as e:
        raise SlotCorrupt(f"slot skeleton cannot be decoded: {type(e).__name__}: {e}") from e
    return payload, (lease if unpickler.views else None)
