"""`frozen(records)`: a list (or dict) of plain Python values held in one buffer, so
that forked workers reading it do not copy it page by page.

Under fork every worker starts with the parent's memory shared copy-on-write. A
dataset that holds its annotations as a list of ~500k dicts loses that sharing as the
epoch runs: reading an object writes its reference count (and a full garbage
collection writes every tracked object's gc header), so each page touched is copied
into the worker, and each worker ends up with its own copy (pytorch/pytorch#13246).
A `FrozenList` keeps no Python object per record: every record is pickled into one
read-only numpy uint8 array, with an int64 array of offsets, and decoded on access.
Reading it writes the refcounts of three objects, not of the records.

What it holds: records made of dict, list, tuple, set, frozenset, str, bytes,
bytearray, int, float, bool and None, nested in any way — exactly these types, no
subclasses (numpy scalars, enums, namedtuples, OrderedDict...), which pickle would
keep only as far as their classes allow; anything else is a TypeError that names the
type and where it is. The keys of a `FrozenDict` itself are str, bytes, int (bool) or
float (not NaN); the keys of dicts inside records may be any held hashable. A lookup
finds every key a dict finds (equal hash() and ==): numpy scalars (`np.int64(102)`),
`1.0` or `True` for `1`, Fraction, Decimal, str subclasses, any object of its own.

Costs and semantics (docs/guide.md, "Memory under fork"): each access decodes a fresh
copy (a few microseconds for a small dict; mutating it does not change the
container); identity is not kept between records (two records that shared one list
decode to two lists; inside one record, sharing is kept as pickle keeps it).
Pickling a container sends its two (three for a dict) arrays and nothing per record:
with protocol 5 they can travel out of band.
"""
from __future__ import annotations

import hashlib
import io
import math
import numbers
import operator
import pickle
import struct
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from decimal import Decimal
from fractions import Fraction
from typing import Any, Callable

import numpy as np

HELD = (dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, bool, type(None))
KEY_TYPES = (str, bytes, int, bool, float)
_HELD_NAMES = "dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, bool and None"


class _Unheld(Exception):
    """Raised inside the pickler for the first value of a type it may not hold."""

    def __init__(self, value: Any):
        super().__init__()
        self.value = value


class _PlainPickler(pickle.Pickler):
    """A pickler that refuses every value outside HELD. The C pickler writes the exact
    built-in types itself and calls reducer_override only for every other object
    (subclasses included), so the check costs nothing per held value."""

    def reducer_override(self, obj: Any) -> Any:
        raise _Unheld(obj)


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _path_to(root: Any, target: Any, path: str) -> str | None:
    """The path of `target` (found by identity) inside `root`, as Python would index it."""
    if root is target:
        return path
    if type(root) is dict:
        for key, value in root.items():
            if key is target:
                return f"{path} (the key {key!r})"
            found = _path_to(key, target, f"{path} (inside the key {key!r})") if type(key) is tuple else None
            found = found or _path_to(value, target, f"{path}[{key!r}]")
            if found:
                return found
    elif type(root) in (list, tuple):
        for i, value in enumerate(root):
            found = _path_to(value, target, f"{path}[{i}]")
            if found:
                return found
    elif type(root) in (set, frozenset):
        for value in root:
            found = _path_to(value, target, f"{path} (the member {value!r})")
            if found:
                return found
    return None


def _unheld_error(value: Any, record: Any, where: str) -> TypeError:
    path = _path_to(record, value, where) or where
    return TypeError(
        f"frozen() cannot hold a value of type {_type_name(value)} at {path}: it holds only "
        f"{_HELD_NAMES} (exactly those types, no subclasses), so that every record "
        f"decodes to what it was. Convert it first (float(x), int(x), x.tolist(), dict(x)) "
        f"or keep it outside the frozen records")


def _encode(records: Any, where: Callable[[int], str]) -> tuple[np.ndarray, np.ndarray]:
    """(data, offsets): record i is pickle.loads(data[offsets[i]:offsets[i + 1]]);
    `where(i)` names record i in an error."""
    stream = io.BytesIO()
    pickler = _PlainPickler(stream, protocol=pickle.HIGHEST_PROTOCOL)
    ends = [0]
    for index, record in enumerate(records):
        pickler.clear_memo()  # every record decodes alone
        try:
            pickler.dump(record)
        except _Unheld as unheld:
            raise _unheld_error(unheld.value, record, where(index)) from None
        ends.append(stream.tell())
    data = np.frombuffer(stream.getbuffer(), np.uint8).copy()
    data.flags.writeable = False
    offsets = np.asarray(ends, dtype=np.int64)
    offsets.flags.writeable = False
    return data, offsets


class _Records:
    """The decoding side of (data, offsets); one per container, a few objects in all."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or offsets.dtype != np.int64 or offsets.ndim != 1:
            raise TypeError(f"frozen records need a 1-d uint8 data array and a 1-d int64 offsets "
                            f"array, got {data.dtype}{list(data.shape)} and "
                            f"{offsets.dtype}{list(offsets.shape)}")
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(data):
            raise ValueError(f"frozen records: offsets must run from 0 to the data's length "
                             f"{len(data)}, got {len(offsets)} offsets")
        # read-only views: the caller's arrays keep their flags
        self.data = np.ascontiguousarray(data).view()
        self.offsets = np.ascontiguousarray(offsets).view()
        self.data.flags.writeable = False
        self.offsets.flags.writeable = False
        self.count = len(offsets) - 1
        self._bytes = memoryview(self.data)  # type: ignore[arg-type]  # numpy arrays export buffers
        self._ends = memoryview(self.offsets)  # type: ignore[arg-type]  # indexing gives ints

    def decode(self, index: int) -> Any:
        return pickle.loads(self._bytes[self._ends[index]:self._ends[index + 1]])

    def __iter__(self) -> Iterator[Any]:
        for index in range(self.count):
            yield self.decode(index)


def _index(position: Any, count: int) -> int:
    index = operator.index(position)
    if index < 0:
        index += count
    if not 0 <= index < count:
        raise IndexError("frozen list index out of range")
    return index


class FrozenList(Sequence):
    """A read-only sequence of plain records held in one buffer; see the module docstring.

    `[i]` decodes a fresh copy of record i (negative indices as on a list); a slice is a
    list (a tuple if the container was made from a tuple) of fresh copies. It equals any
    list, tuple or FrozenList with equal elements in the same order (a tuple and a list
    never compare equal in Python; a frozen sequence compares by elements only).
    """

    def __init__(self, records: list | tuple):
        if type(records) not in (list, tuple):
            raise TypeError(f"FrozenList takes a list or tuple, got {_type_name(records)}")
        self._kind: type = type(records)
        self._records = _Records(*_encode(records, "[{}]".format))

    @classmethod
    def from_arrays(cls, data: np.ndarray, offsets: np.ndarray, kind: type = list) -> FrozenList:
        """The container over arrays made by another FrozenList (`data`, `offsets`), e.g.
        arrays mapped from shared memory; nothing is copied."""
        if kind not in (list, tuple):
            raise TypeError(f"FrozenList.from_arrays: kind must be list or tuple, got {kind!r}")
        self = cls.__new__(cls)
        self._kind = kind
        self._records = _Records(data, offsets)
        return self

    @property
    def data(self) -> np.ndarray:
        """All records, pickled one after another (read-only)."""
        return self._records.data

    @property
    def offsets(self) -> np.ndarray:
        """Where each record starts in `data`, and where the last ends (len + 1 values)."""
        return self._records.offsets

    @property
    def nbytes(self) -> int:
        return self._records.data.nbytes + self._records.offsets.nbytes

    def __len__(self) -> int:
        return self._records.count

    def __getitem__(self, position: Any) -> Any:
        if isinstance(position, slice):
            return self._kind(self._records.decode(i) for i in range(*position.indices(len(self))))
        return self._records.decode(_index(position, len(self)))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._records)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (FrozenList, list, tuple)):
            return NotImplemented
        if len(other) != len(self):
            return False
        if (isinstance(other, FrozenList) and np.array_equal(other.offsets, self.offsets)
                and np.array_equal(other.data, self.data)):
            return True  # the same bytes (unequal bytes may still decode to equal records)
        return all(a is b or a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # compares by value, like a list

    def __repr__(self) -> str:
        return (f"<poolloader.FrozenList of {len(self)} records from a {self._kind.__name__}, "
                f"{self.nbytes} bytes>")

    def __reduce__(self) -> tuple:
        return FrozenList.from_arrays, (self.data, self.offsets, self._kind)


def _key_id(key: Any) -> bytes:
    """Bytes that equal keys share (as a dict's lookup sees them: 1 == 1.0 == True) and
    unequal keys do not; the same in every process (str's hash() is not)."""
    kind = type(key)
    if kind is str:
        return b"s" + key.encode("utf-8", "surrogatepass")
    if kind is bytes:
        return b"b" + key
    if kind is float and not key.is_integer():
        return b"f" + struct.pack("<d", key)
    number = int(key)
    return b"i" + number.to_bytes(number.bit_length() // 8 + 1, "little", signed=True)


def _key_hash(key_id: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key_id, digest_size=8).digest(), "little", signed=True)


def _plain_key(key: Any) -> Any:
    """The str, bytes, int or float that equals `key` when it is a str or bytes subclass
    (numpy's included) or a number (numpy scalars, Fraction, Decimal, complex with no
    imaginary part, an IntEnum); None for any other key and for NaN."""
    if isinstance(key, str):
        return str.__str__(key)  # exactly a str, whatever the subclass's __str__ says
    if isinstance(key, bytes):
        return bytes(memoryview(key))
    if not isinstance(key, (numbers.Number, np.number, np.bool_)):
        return None
    try:
        if isinstance(key, numbers.Complex) and not isinstance(key, numbers.Real):
            if key.imag != 0:
                return None
            key = key.real
        try:
            whole = int(key)
        except (ValueError, OverflowError):  # NaN, infinity
            whole = None
        if whole is not None and whole == key:
            return whole  # exact, also beyond a float's 53 bits (Fraction, Decimal)
        number = float(key)
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return None
    return None if math.isnan(number) else number


# Types whose == with a str, bytes, int or float is by value: a key of one of them equals
# a stored key only if it equals its _plain_key (or, having none, equals no stored key).
_BY_VALUE = frozenset((kind.__eq__, kind.__hash__) for kind in (
    str, bytes, int, bool, float, complex, Fraction, Decimal, tuple, frozenset, type(None)))
_NUMPY_BY_VALUE = (np.number, np.bool_, np.str_, np.bytes_)


def _by_value(key: Any) -> bool:
    kind = type(key)
    if kind.__module__ == "numpy":
        return issubclass(kind, _NUMPY_BY_VALUE)
    return (kind.__eq__, kind.__hash__) in _BY_VALUE


def _dict_equal(stored: Any, key: Any, key_hash: int) -> bool:
    """Whether a dict holding `stored` finds it for `key` (whose hash() is `key_hash`)."""
    return hash(stored) == key_hash and bool(stored == key)


def _check_key(key: Any) -> None:
    if type(key) not in KEY_TYPES:
        raise TypeError(
            f"frozen() of a dict takes keys of type str, bytes, int, bool or float; the key "
            f"{key!r} is a {_type_name(key)}. Freeze a list of (key, value) pairs, or map the "
            f"keys to str or int first")
    if type(key) is float and math.isnan(key):
        raise TypeError("frozen() of a dict cannot hold the key nan: a NaN key is found only "
                        "by identity, which a frozen dict does not keep. Map it to another key")


class FrozenDict(Mapping):
    """A read-only mapping of plain values held in buffers; see the module docstring.

    Keys keep their order. `[key]`, `get` and `in` look the key up through a sorted array
    of 64-bit key hashes (stable across processes) and decode the value; `keys()`,
    `values()` and `items()` decode in order. It equals any mapping with equal items.
    A key of another type finds what a dict finds: a number (numpy scalars, Fraction,
    Decimal) or a str / bytes subclass through the plain value it equals; an object with
    its own __eq__ and __hash__ through the stored keys' hash() values, computed once per
    process at the first such lookup.
    """

    def __init__(self, mapping: dict):
        if type(mapping) is not dict:
            raise TypeError(f"FrozenDict takes a dict, got {_type_name(mapping)}")
        for key in mapping:
            _check_key(key)
        hashes = np.fromiter((_key_hash(_key_id(k)) for k in mapping), np.int64, len(mapping))
        order = np.argsort(hashes, kind="stable")
        keys = list(mapping)
        self._init(_Records(*_encode(keys, "the key at position {}".format)),
                   _Records(*_encode(mapping.values(), lambda i: f"[{keys[i]!r}]")),
                   hashes[order], order.astype(np.int64))

    def _init(self, keys: _Records, values: _Records, hashes: np.ndarray, order: np.ndarray) -> None:
        if keys.count != values.count or len(hashes) != keys.count or len(order) != keys.count:
            raise ValueError(f"FrozenDict: {keys.count} keys, {values.count} values, {len(hashes)} "
                             f"hashes and {len(order)} positions; they must be as many")
        hashes, order = hashes.astype(np.int64, copy=False).view(), order.astype(np.int64, copy=False).view()
        hashes.flags.writeable = False
        order.flags.writeable = False
        self._keys, self._values, self._hashes, self._order = keys, values, hashes, order
        self._python_hashes: tuple[np.ndarray, np.ndarray] | None = None  # _find_by_python_hash

    @classmethod
    def from_arrays(cls, keys: tuple[np.ndarray, np.ndarray], values: tuple[np.ndarray, np.ndarray],
                    hashes: np.ndarray, order: np.ndarray) -> FrozenDict:
        """The mapping over arrays made by another FrozenDict (what it pickles to)."""
        self = cls.__new__(cls)
        self._init(_Records(*keys), _Records(*values), hashes, order)
        return self

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self._keys.data, self._keys.offsets, self._values.data,
                                      self._values.offsets, self._hashes, self._order))

    def _find(self, key: Any) -> int:
        """The position of the stored key a dict would find for `key`, -1 if none."""
        if type(key) in KEY_TYPES:  # the fast path: equal keys share a _key_id
            return -1 if type(key) is float and math.isnan(key) else self._find_id(_key_id(key))
        wanted = hash(key)  # unhashable: TypeError, as a dict's
        plain = _plain_key(key)
        if plain is not None:
            position = self._find_id(_key_id(plain))
            if position >= 0 and _dict_equal(self._keys.decode(position), key, wanted):
                return position
        if _by_value(key):  # it equals no stored key but `plain`
            return -1
        return self._find_by_python_hash(key, wanted)

    def _find_id(self, key_id: bytes) -> int:
        h = np.int64(_key_hash(key_id))
        start = int(np.searchsorted(self._hashes, h, "left"))
        for slot in range(start, len(self._hashes)):
            if self._hashes[slot] != h:
                break
            position = int(self._order[slot])
            if _key_id(self._keys.decode(position)) == key_id:
                return position
        return -1

    def _find_by_python_hash(self, key: Any, wanted: int) -> int:
        """A key of a type with its own __eq__ and __hash__, found as a dict finds it: a
        stored key with the same hash() that compares equal. The stored keys' hash() values
        are computed at the first such lookup in a process (16 bytes a key; str's hash()
        differs between processes, so they are never pickled)."""
        if self._python_hashes is None:
            hashes = np.fromiter((hash(k) for k in self._keys), np.int64, self._keys.count)
            order = np.argsort(hashes, kind="stable")
            self._python_hashes = (hashes[order], order)
        hashes, order = self._python_hashes
        for slot in range(int(np.searchsorted(hashes, wanted, "left")), len(hashes)):
            if hashes[slot] != wanted:
                break
            position = int(order[slot])
            if _dict_equal(self._keys.decode(position), key, wanted):
                return position
        return -1

    def __getitem__(self, key: Any) -> Any:
        position = self._find(key)
        if position < 0:
            raise KeyError(key)
        return self._values.decode(position)

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def __len__(self) -> int:
        return self._keys.count

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def values(self) -> ValuesView:
        return _Values(self)

    def items(self) -> ItemsView:
        return _Items(self)

    def iter_values(self) -> Iterator[Any]:
        return iter(self._values)

    def __repr__(self) -> str:
        return f"<poolloader.FrozenDict of {len(self)} items, {self.nbytes} bytes>"

    def __reduce__(self) -> tuple:
        return FrozenDict.from_arrays, ((self._keys.data, self._keys.offsets),
                                        (self._values.data, self._values.offsets),
                                        self._hashes, self._order)


class _Values(ValuesView):
    """values() of a FrozenDict: decoded in order, not looked up key by key."""

    def __init__(self, mapping: FrozenDict):
        super().__init__(mapping)
        self._frozen = mapping

    def __iter__(self) -> Iterator[Any]:
        return self._frozen.iter_values()


class _Items(ItemsView):
    """items() of a FrozenDict: decoded in order, not looked up key by key."""

    def __init__(self, mapping: FrozenDict):
        super().__init__(mapping)
        self._frozen = mapping

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(iter(self._frozen), self._frozen.iter_values())


def frozen(records: Any) -> Any:
    """`records` (a list or tuple of plain values, or a dict of them) as a read-only
    FrozenList (FrozenDict) held in one buffer, for a dataset that forked workers read:
    `self.annotations = poolloader.frozen(annotations)`. A frozen container is returned
    as it is. Costs one pickling of every record now, and one decoding per access."""
    if isinstance(records, (FrozenList, FrozenDict)):
        return records
    if type(records) in (list, tuple):
        return FrozenList(records)
    if type(records) is dict:
        return FrozenDict(records)
    raise TypeError(f"frozen() takes a list, tuple or dict of plain values, got "
                    f"{_type_name(records)}; convert it first (list(x), dict(x))")
