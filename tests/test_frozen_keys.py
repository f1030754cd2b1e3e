"""A FrozenDict finds every key a dict finds (issue 44 item 5).

A dict finds a stored key for `key` when their hash() values are equal and they compare
equal: numpy scalars (`np.int64(102)` from an array of image ids), `True` / `1` / `1.0`,
Fraction, Decimal, complex, an IntEnum, str and bytes subclasses, or any object whose
__hash__ and __eq__ say so. The dict is the oracle: every lookup form (`[]`, `in`,
`.get`, `keys()`) must give what the dict gives, for random keys of mixed types.
"""
from __future__ import annotations

import enum
import math
import pickle
import warnings
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poolloader import FrozenDict, frozen

MISSING = object()


class Small(enum.IntEnum):
    MINUS = -1
    ZERO = 0
    ONE = 1
    TWO = 2


class Text(str):
    def __str__(self) -> str:  # a subclass's own __str__ does not change what it equals
        return "not me"


class Raw(bytes):
    pass


class Alias:
    """Equal to the key it wraps, with its hash(): a dict finds the key for it."""

    def __init__(self, key):
        self.key = key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return other == self.key

    def __repr__(self) -> str:
        return f"Alias({self.key!r})"


def _forms(key) -> list:
    """`key` as the other types a lookup may bring it in (those that can hold it)."""
    forms = [key, Alias(key), (key,), frozenset([key]), None]
    if isinstance(key, str):
        return [*forms, Text(key), np.str_(key)]
    if isinstance(key, bytes):
        return [*forms, Raw(key), np.bytes_(key)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a float32 or float16 overflows to inf: a lookup still
        if isinstance(key, bool):
            forms.append(np.bool_(key))
        if isinstance(key, int):
            if -(2 ** 63) <= key < 2 ** 63:
                forms.append(np.int64(key))
            if 0 <= key < 2 ** 64:
                forms.append(np.uint64(key))
            if -128 <= key < 128:
                forms.append(np.int8(key))
            if key in {m.value for m in Small}:
                forms.append(Small(key))
        if not isinstance(key, float) or math.isfinite(key):
            forms += [Fraction(key), Decimal(key)]
        try:
            real = float(key)
        except OverflowError:
            return forms
        forms += [np.float64(real), np.float32(real), np.float16(real), np.longdouble(real),
                  complex(real), np.complex64(real), complex(real, 1.0), real + 0.5]
    return forms


plain_keys = st.one_of(st.integers(), st.integers(-3, 3), st.floats(allow_nan=False),
                       st.sampled_from([0.5, -0.0, 1.0, 2.0, math.inf, -math.inf]),
                       st.text(max_size=4), st.binary(max_size=4), st.booleans())


def assert_finds_as_the_dict(original: dict, held: FrozenDict, probe) -> None:
    found = probe in original
    assert (probe in held) is found, f"{probe!r}: in the dict {found}"
    assert (probe in held.keys()) is found, f"{probe!r} in keys()"
    assert held.get(probe, MISSING) == original.get(probe, MISSING), f"{probe!r}: get()"
    if found:
        assert held[probe] == original[probe], f"{probe!r}: []"
    else:
        with pytest.raises(KeyError):
            held[probe]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=st.lists(plain_keys, max_size=12), absent=st.lists(plain_keys, max_size=6))
def test_every_lookup_finds_what_a_dict_finds(keys, absent):
    original: dict = {}
    for value, key in enumerate(keys):
        original[key] = value  # equal keys (True, 1, 1.0) collapse as in any dict
    held = frozen(original)
    assert list(held.keys()) == list(original.keys())
    assert [type(k) for k in held] == [type(k) for k in original]  # the stored keys, as stored
    for key in [*keys, *absent]:
        for probe in _forms(key):
            assert_finds_as_the_dict(original, held, probe)
    for probe in (math.nan, np.float64("nan"), Decimal("nan"), complex(math.nan, 0)):
        assert_finds_as_the_dict(original, held, probe)


def test_image_ids_from_a_numpy_array_find_their_boxes():
    # the report: ids read from an array are np.int64; .get(id, []) gave [] silently
    boxes = {102: [[1.0, 2.0, 3.0, 4.0]], 7: [], 2 ** 40: [[0.0, 0.0, 1.0, 1.0]]}
    held = frozen(boxes)
    ids = np.array([102, 7, 2 ** 40, 5], dtype=np.int64)
    assert [held.get(i, "none") for i in ids] == [boxes.get(i, "none") for i in ids]
    assert held[ids[0]] == [[1.0, 2.0, 3.0, 4.0]] and ids[0] in held and ids[3] not in held
    scores = frozen(dict([(0.5, "half"), (1.0, "one"), (True, "yes")]))
    assert scores == {0.5: "half", 1.0: "yes"}  # as a dict, 1.0 and True are one key
    assert scores[np.float32(0.5)] == "half" and scores[np.True_] == scores[1] == "yes"


def test_numbers_and_text_subclasses_need_no_table_of_python_hashes():
    # numpy scalars, Fraction, str subclasses: found through the key's plain value, so a
    # lookup (a miss too) never builds the per-process table of the stored keys' hash()
    held = frozen({i: i for i in range(100)} | {"a": 0, b"b": 1, 0.25: 2})
    for probe in (np.int64(5), np.int64(500), np.float32(0.25), Fraction(1, 3), Decimal(7),
                  np.str_("a"), Text("zz"), np.bytes_(b"b"), Small.TWO, (1,), None, 3 + 4j):
        assert (probe in held) is (probe in dict(held.items()))
    assert held._python_hashes is None
    assert held[Alias("a")] == 0 and Alias("q") not in held  # an object of its own: the table
    assert held._python_hashes is not None


def test_a_lookup_after_pickling_finds_what_the_dict_finds():
    original = {"img1.jpg": 1, 102: 2, 0.5: 3}
    held = frozen(original)
    assert held[Alias("img1.jpg")] == 1  # builds this process's table
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        copy = pickle.loads(pickle.dumps(held, protocol))
        assert copy._python_hashes is None  # hash() of str differs between processes
        for probe in (np.int64(102), np.float64(0.5), Alias("img1.jpg"), Alias(102), "x"):
            assert copy.get(probe, MISSING) == original.get(probe, MISSING)


@pytest.mark.parametrize("unhashable", [[1], {}, np.array([1]), bytearray(b"a"), {1}])
def test_an_unhashable_key_is_a_type_error_as_in_a_dict(unhashable):
    original = {1: "one", "a": "b"}
    held = frozen(original)
    for mapping in (original, held):
        with pytest.raises(TypeError, match="unhashable"):
            mapping[unhashable]
        with pytest.raises(TypeError, match="unhashable"):
            unhashable in mapping  # noqa: B015 -- the lookup is the point
        with pytest.raises(TypeError, match="unhashable"):
            mapping.get(unhashable)
