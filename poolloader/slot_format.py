"""The byte layout of one slot, and how a batch is encoded into it and decoded out.

A slot is one page-aligned shared segment:

    0            header: HEADER_FIELDS u64, fields F_* below
    REQUEST_OFF  request area: main writes the pickled sampler index here
    DATA_OFF     data region: tensor and array bytes, each 64-byte aligned,
                 then the skeleton (at F_SKELETON_OFF)
    slot size    (page multiple)

The skeleton is the batch pickled with every plain CPU tensor and numpy array
replaced by a persistent id (kind, dtype code, byte offset, shape, strides)
that points into the data region. Decoding unpickles it and turns each id into
a view over the slot: O(objects), never O(bytes). Everything else (strings,
numbers, dicts, namedtuples, dataclasses, tensor subclasses, sparse, quantized,
tensors that require grad or carry a conj/neg bit, object arrays) is pickled
into the skeleton as DataLoader's own pickling would carry it: lossless, one
copy, documented as the fallback.

Keep the F_* indices in sync with the worker (writer) and iterator (reader):
both use only this module.
"""
from __future__ import annotations

import io
import pickle
import zlib

import numpy as np
import torch

from poolloader.errors import SlotCorrupt

SLOT_MAGIC = 0x746F6C536C50  # "PlSlot"
HEADER_FIELDS = 16
(F_MAGIC,          # SLOT_MAGIC
 F_STATUS,         # one of the ST_* values
 F_SEQ,            # the batch's send index within its epoch (main writes, worker echoes)
 F_EPOCH,          # main's epoch counter: a new value makes the worker restart its fetcher
 F_WORKER,         # worker id that wrote the reply
 F_REQUEST_LEN,    # bytes of pickled index in the request area
 F_DATA_LEN,       # bytes of the data region in use (64-byte multiple)
 F_SKELETON_OFF,   # absolute offset of the skeleton (>= DATA_OFF)
 F_SKELETON_LEN,   # its length in bytes
 F_NEEDED,         # ST_GROW: slot bytes the payload needs
 F_SLOT_SIZE,      # the slot size the writer saw
 F_SKELETON_CRC,   # zlib.crc32 of the skeleton: a torn or stray write never reaches pickle
 ) = range(12)
REQUEST_OFF = HEADER_FIELDS * 8
DATA_OFF = 65536
REQUEST_MAX = DATA_OFF - REQUEST_OFF
MIN_SLOT_BYTES = DATA_OFF + 4096

ST_REQUESTED, ST_READY, ST_GROW, ST_ERROR, ST_END = 1, 2, 3, 4, 5

_T, _A = 1, 2  # persistent id kinds: torch tensor, numpy array

# Dense dtypes a slot carries as views; the code is the index here.
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.complex32, torch.uint16, torch.uint32, torch.uint64,
]
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
ITEMSIZE = [dt.itemsize for dt in DTYPES]
_NUM_DTYPES = len(DTYPES)


def align64(n: int) -> int:
    return (n + 63) & ~63


def header_view(mapping) -> np.ndarray:
    return np.ndarray((HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)


def span_elements(shape, stride) -> int:
    """Elements of storage a strided view covers from its first element (0 if empty)."""
    n = 1
    for size, st in zip(shape, stride):
        if size == 0:
            return 0
        n += (size - 1) * st
    return n


# ---------------------------------------------------------------------------
# requests (main writes, worker reads)

def write_request(mapping, header: np.ndarray, seq: int, epoch: int, index) -> None:
    payload = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > REQUEST_MAX:
        raise ValueError(
            f"the sampler index of batch {seq} pickles to {len(payload)} bytes, over the "
            f"slot request area's {REQUEST_MAX} bytes; use a smaller batch_size or a "
            "sampler that yields plain integers")
    memoryview(mapping)[REQUEST_OFF:REQUEST_OFF + len(payload)] = payload
    header[F_MAGIC] = SLOT_MAGIC
    header[F_STATUS] = ST_REQUESTED
    header[F_SEQ] = seq
    header[F_EPOCH] = epoch
    header[F_REQUEST_LEN] = len(payload)


def read_request(mapping, header: np.ndarray):
    n = int(header[F_REQUEST_LEN])
    if n > REQUEST_MAX:
        raise SlotCorrupt(f"request length {n} exceeds the request area ({REQUEST_MAX} bytes)")
    return pickle.loads(memoryview(mapping)[REQUEST_OFF:REQUEST_OFF + n])


# ---------------------------------------------------------------------------
# worker side: allocate in the slot, encode a payload

class NeedsGrow(Exception):
    """The payload needs a slot of `needed` bytes; nothing was published."""

    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


class SlotWriter:
    """Fills one slot's data region (worker side, one batch at a time).

    `empty()` hands out 64-byte-aligned tensors inside the slot, so a collate
    writes each byte once (None when the slot is full). `alloc()` keeps counting
    past the end, so a single NeedsGrow reports the whole size needed.
    """

    def __init__(self):
        self.mapping = None
        self._cache = {}

    def begin(self, mapping) -> None:
        self.mapping = mapping
        cached = self._cache.get(id(mapping))
        if cached is None or cached[0] is not mapping:
            u8 = torch.from_numpy(np.frombuffer(mapping, np.uint8))
            cached = (mapping, u8, np.frombuffer(mapping, np.uint8))
            self._cache = {id(mapping): cached}  # one generation at a time
        self.u8 = cached[1]
        self.np_u8 = cached[2]
        self.address = mapping.address
        self.limit = mapping.size
        self.cursor = DATA_OFF

    def end(self) -> None:
        self.mapping = None

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


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file, writer: SlotWriter):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer = writer
        self.memo_ids = {}
        self.keep = []

    def persistent_id(self, obj):
        kind = type(obj)
        if kind is torch.Tensor:
            return self._tensor(obj)
        if kind is np.ndarray:
            return self._array(obj)
        return None

    def _tensor(self, t: torch.Tensor):
        code = DTYPE_CODE.get(t.dtype)
        if (code is None or t.layout != torch.strided or t.device.type != "cpu"
                or t.requires_grad or t.is_conj() or t.is_neg()):
            return None
        pid = self.memo_ids.get(id(t))
        if pid is not None:
            return pid
        shape, stride = tuple(t.shape), t.stride()
        nbytes = span_elements(shape, stride) * ITEMSIZE[code]
        w = self.writer
        off = w.locate(t, nbytes)
        if off is None:
            off = w.alloc(nbytes)
            if off is None:
                off = DATA_OFF  # overflow: keep counting, NeedsGrow follows
            elif nbytes:
                src = torch.as_strided(t, (nbytes // ITEMSIZE[code],), (1,), t.storage_offset())
                w.u8[off:off + nbytes].view(t.dtype).copy_(src)
        pid = (_T, code, off, shape, stride)
        self.memo_ids[id(t)] = pid
        self.keep.append(t)
        return pid

    def _array(self, a: np.ndarray):
        if a.dtype.hasobject or a.dtype.fields is not None:
            return None
        order = "F" if (a.flags.f_contiguous and not a.flags.c_contiguous) else "C"
        w = self.writer
        off = w.alloc(a.nbytes)
        if off is None:
            off = DATA_OFF
        elif a.nbytes:
            dst = np.ndarray(a.shape, a.dtype, buffer=w.np_u8, offset=off, order=order)
            dst[...] = a
        return (_A, a.dtype.str, off, a.shape, order)


def encode(writer: SlotWriter, header: np.ndarray, payload, status: int) -> None:
    """Write `payload` into the slot `writer` has begun and fill the header.

    Raises NeedsGrow (header untouched but F_NEEDED) when it does not fit, and
    whatever pickling raises for an object that cannot be carried at all.
    """
    buf = io.BytesIO()
    _SkeletonPickler(buf, writer).dump(payload)
    skeleton = buf.getbuffer()
    data_len = align64(writer.cursor) - DATA_OFF
    skel_off = DATA_OFF + data_len
    needed = skel_off + len(skeleton)
    if needed > writer.limit:
        raise NeedsGrow(needed)
    writer.np_u8[skel_off:needed] = np.frombuffer(skeleton, np.uint8)
    header[F_SKELETON_CRC] = zlib.crc32(skeleton)
    header[F_DATA_LEN] = data_len
    header[F_SKELETON_OFF] = skel_off
    header[F_SKELETON_LEN] = len(skeleton)
    header[F_SLOT_SIZE] = writer.limit
    header[F_MAGIC] = SLOT_MAGIC
    header[F_STATUS] = status


# ---------------------------------------------------------------------------
# main side: decode views

def _rebuild_sparse_checked(layout, data):
    """torch._utils._rebuild_sparse_tensor, validated at once.

    torch's version defers validation to a module-level list that only
    torch.load drains: under this unpickler the list would keep every sparse
    tensor, and so its slot, alive forever. Its indices are views of the slot,
    so an unchecked index could also reach outside the tensor: check always.
    """
    if layout == torch.sparse_coo:
        indices, values, size, *rest = data
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=True,
                                       is_coalesced=rest[0] if rest else None)
    compressed_indices, plain_indices, values, size = data
    return torch.sparse_compressed_tensor(compressed_indices, plain_indices, values, size,
                                          layout=layout, check_invariants=True)


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, file, data: np.ndarray, data_end: int):
        super().__init__(file)
        self.data = data          # uint8 array over [DATA_OFF, data_end): the lease object
        self.data_end = data_end
        self.base = None
        self.typed = [None] * _NUM_DTYPES
        self.views = 0

    def find_class(self, module, name):
        if name == "_rebuild_sparse_tensor" and module == "torch._utils":
            return _rebuild_sparse_checked
        return super().find_class(module, name)

    def persistent_load(self, pid):
        # Hot path: one call per tensor of the batch, so it checks only what torch
        # does not: the kind, the dtype code and the offset's alignment. torch's
        # as_strided rejects negative or overflowing sizes and strides and any view
        # past the end of its storage, and that storage is exactly the slot's data
        # region, so no view can reach outside the slot.
        try:
            kind, code, off, shape, stride = pid
            if kind == _T and 0 <= code < _NUM_DTYPES:
                itemsize = ITEMSIZE[code]
                if off >= DATA_OFF and not off % itemsize:
                    typed = self.typed[code]
                    if typed is None:
                        typed = self._typed(code)
                    view = typed.as_strided(shape, stride, (off - DATA_OFF) // itemsize)
                    self.views += 1
                    return view
            elif kind == _A:
                return self._array(code, off, shape, stride)
        except SlotCorrupt:
            raise
        except (TypeError, ValueError, IndexError, RuntimeError, OverflowError) as e:
            raise SlotCorrupt(f"persistent id {pid!r} does not describe a view inside the "
                              f"slot's data region [{DATA_OFF}, {self.data_end}): {e}") from None
        raise SlotCorrupt(f"malformed persistent id {pid!r}")

    def _typed(self, code: int) -> torch.Tensor:
        if self.base is None:
            self.base = torch.from_numpy(self.data)
        typed = self.typed[code] = self.base.view(DTYPES[code])
        return typed

    def _array(self, dtype_str, off, shape, order):
        # As for tensors, numpy's own checks bound the view's end: `self.data` is
        # exactly the data region and np.ndarray rejects a buffer too small, a
        # negative dimension and non-integer shapes. It accepts a negative offset
        # (pointing before the region), so the start is checked here.
        dtype = np.dtype(dtype_str)
        if (dtype.hasobject or order not in ("C", "F") or type(shape) is not tuple
                or type(off) is not int or off < DATA_OFF):
            raise SlotCorrupt(f"invalid array dtype {dtype_str!r}, order {order!r} or shape {shape!r}")
        view = np.ndarray(shape, dtype, buffer=self.data, offset=off - DATA_OFF, order=order)
        self.views += 1
        return view


def check_header(header: np.ndarray, slot_size: int) -> tuple[int, int, int]:
    """Validate a published header against the slot size; returns (data_len, skel_off, skel_len)."""
    if int(header[F_MAGIC]) != SLOT_MAGIC:
        raise SlotCorrupt(f"bad slot magic {int(header[F_MAGIC]):#x}")
    data_len = int(header[F_DATA_LEN])
    skel_off = int(header[F_SKELETON_OFF])
    skel_len = int(header[F_SKELETON_LEN])
    if (data_len % 64 or DATA_OFF + data_len > slot_size or skel_off < DATA_OFF + data_len
            or skel_off + skel_len > slot_size):
        raise SlotCorrupt(
            f"slot header out of bounds: data {data_len} bytes, skeleton {skel_len} bytes at "
            f"{skel_off}, slot {slot_size} bytes")
    return data_len, skel_off, skel_len


def decode(mapping, header: np.ndarray):
    """Rebuild the payload of a published slot as views over it.

    Returns (payload, lease) where `lease` is the uint8 array every view keeps
    alive (directly or through torch's storage), or None when the payload holds
    no view (then the slot can be reused at once).
    """
    data_len, skel_off, skel_len = check_header(header, mapping.size)
    data = np.frombuffer(mapping, np.uint8, count=data_len, offset=DATA_OFF)
    skeleton = bytes(memoryview(mapping)[skel_off:skel_off + skel_len])
    crc = zlib.crc32(skeleton)
    if crc != int(header[F_SKELETON_CRC]):
        raise SlotCorrupt(f"slot skeleton checksum {crc:#010x} does not match the header's "
                          f"{int(header[F_SKELETON_CRC]):#010x} ({skel_len} bytes at {skel_off})")
    unpickler = _SkeletonUnpickler(io.BytesIO(skeleton), data, DATA_OFF + data_len)
    try:
        payload = unpickler.load()
    except SlotCorrupt:
        raise
    except Exception as e:
        raise SlotCorrupt(f"slot skeleton cannot be decoded: {type(e).__name__}: {e}") from e
    return payload, (data if unpickler.views else None)
