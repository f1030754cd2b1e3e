"""Detection batches in few objects: padded images, a padding mask, packed targets.

A detection sample is `(image [C,H,W], target dict)`. Collated the usual way, a
batch of B samples is B images plus B dicts of ~7 small tensors each, and both
DataLoader and a slot pay per object. `DetectionCollate` writes the images into
ONE padded tensor and its padding mask (both allocated in the slot with
`slot_empty`, so they are written once), and `pack_targets` turns the B dicts
into one tensor per field plus per-sample counts: a batch of 16 goes from ~114
objects to ~10, with every value bit-identical.

Packing is lossless or it does not happen: whatever cannot be concatenated
without changing a value, a dtype, a shape or a type is returned unchanged (the
documented fallback, see `pack_targets`).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from poolloader.collate import slot_empty
from poolloader.wire import codec

# Fields that describe the image, not its instances: stacked [B, ...] whenever
# their shape is the same in every sample, even if it happens to equal the
# instance count (orig_size [2] in a batch where every image has 2 objects).
PER_IMAGE_KEYS = ("image_id", "orig_size", "size")
# The field whose dim 0 is the per-sample instance count, first one present.
COUNT_KEYS = ("labels", "boxes")


class PackedTargets:
    """A batch of per-sample target dicts held as one tensor per field.

    Two kinds of field, both bit-identical to what was packed:

    * instance fields (boxes [N,4], labels [N], masks [N,H,W], keypoints
      [N,K,3], ...): the samples' tensors concatenated along dim 0; sample i
      owns rows `offsets[i]:offsets[i+1]`, where `counts[i]` is its instance count;
    * per-image fields (image_id [1] or [], orig_size [2], size [2], ...): the
      samples' tensors stacked, [B, *shape]; sample i is row i. Their names are
      in `stacked`.

    `fields` (dict name -> tensor, in the samples' key order), `counts` (int64
    [B]) and `stacked` (frozenset of names) are the whole state; pickling
    carries those tensors as they are, so inside a PoolLoader slot they arrive
    as views over the slot.

    `pt[i]`, iteration and `as_list()` rebuild each sample's dict out of views
    (narrow / select) of the packed fields: nothing is copied, so a mask field
    is never held twice. An in-place write into such a view writes the packed
    field (and only that sample's rows of it); replacing a key of the returned
    dict does not. `.clone()` what you want to own.

    Deliberately not a `collections.abc.Sequence`: torch's pin-memory code takes
    a Sequence apart element by element, which would unpack the batch. It has
    `pin_memory()` and `to(device, non_blocking=...)` instead, each moving one
    tensor per field.
    """

    __slots__ = ("fields", "counts", "stacked", "_offsets")

    def __init__(self, fields: dict, counts: torch.Tensor, stacked=()):
        """Validate and wrap already-packed fields (pack_targets builds these)."""
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or counts.dim() != 1:
            raise TypeError(f"counts must be a 1-D int64 tensor, got {_describe(counts)}")
        stacked = frozenset(stacked)
        missing = stacked.difference(fields)
        if missing:
            raise ValueError(f"stacked names {sorted(map(repr, missing))} are not fields")
        count_list = counts.tolist()
        if any(c < 0 for c in count_list):
            raise ValueError(f"counts must be >= 0, got {count_list}")
        offsets = _offsets(count_list)
        batch, total = len(count_list), offsets[-1]
        for key, value in fields.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"field {key!r} must be a tensor, got {_describe(value)}")
            rows = batch if key in stacked else total
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(
                    f"field {key!r} has shape {tuple(value.shape)}; a "
                    f"{'stacked' if key in stacked else 'instance'} field needs {rows} rows "
                    f"({batch} samples, {total} instances)")
        self.fields = dict(fields)
        self.counts = counts
        self.stacked = stacked
        self._offsets = offsets

    @classmethod
    def _unchecked(cls, fields: dict, counts: torch.Tensor, stacked: frozenset,
                   offsets: tuple) -> PackedTargets:
        self = cls.__new__(cls)
        self.fields = fields
        self.counts = counts
        self.stacked = stacked
        self._offsets = offsets
        return self

    def __reduce__(self):
        # Plain state: a dict of tensors, the counts tensor, names and ints.
        return (_rebuild_packed, (self.fields, self.counts, tuple(self.stacked), self._offsets))

    # -- per-sample access ------------------------------------------------------
    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):
        """Sample `index`'s target dict (views), or a list of them for a slice."""
        n = len(self)
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(n))]
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {index} out of range for a batch of {n}")
        start, stop = self._offsets[i], self._offsets[i + 1]
        stacked = self.stacked
        return {key: value[i] if key in stacked else value[start:stop]
                for key, value in self.fields.items()}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def as_list(self) -> list[dict]:
        """Every sample's dict, as views of the packed fields (no copy)."""
        return [self[i] for i in range(len(self))]

    # -- moving ------------------------------------------------------------------
    def to(self, device, non_blocking: bool = False) -> PackedTargets:
        """A PackedTargets on `device`: one copy per field (and one for counts)."""
        fields = {k: v.to(device, non_blocking=non_blocking) for k, v in self.fields.items()}
        return PackedTargets._unchecked(fields, self.counts.to(device, non_blocking=non_blocking),
                                        self.stacked, self._offsets)

    def pin_memory(self) -> PackedTargets:
        """A PackedTargets in page-locked memory (what torch's pin-memory thread calls)."""
        return self.map_tensors(torch.Tensor.pin_memory)

    def map_tensors(self, fn) -> PackedTargets:
        """The same targets with `fn(tensor)` in place of every field and the counts (which
        must keep their shapes): how a loader pins or moves them its own way."""
        fields = {k: fn(v) for k, v in self.fields.items()}
        return PackedTargets._unchecked(fields, fn(self.counts), self.stacked, self._offsets)

    def is_pinned(self) -> bool:
        """True when counts and every field are in page-locked memory."""
        return self.counts.is_pinned() and all(v.is_pinned() for v in self.fields.values())

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{k!r}: {'stacked ' if k in self.stacked else ''}{str(v.dtype).replace('torch.', '')}"
            f"{list(v.shape)}" for k, v in self.fields.items())
        return (f"PackedTargets(batch={len(self)}, instances={self._offsets[-1]}, "
                f"fields={{{parts}}})")


def _rebuild_packed(fields, counts, stacked, offsets) -> PackedTargets:
    return PackedTargets._unchecked(fields, counts, frozenset(stacked), tuple(offsets))


# its rebuild makes no tensor of its own: batches of it keep untracked views (codec)
codec.allow_untracked(PackedTargets, _rebuild_packed)


def _offsets(counts) -> tuple:
    out, total = [0], 0
    for c in counts:
        total += c
        out.append(total)
    return tuple(out)


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{type(obj).__name__}({obj.dtype}, {tuple(obj.shape)}, {obj.layout}, {obj.device})"
    return type(obj).__name__


def _packable(value) -> bool:
    """A plain dense tensor torch.cat/stack copy exactly (no subclass, grad, names)."""
    return (type(value) is torch.Tensor and value.layout == torch.strided
            and not value.is_quantized and not value.is_nested
            and not value.requires_grad and not any(getattr(value, "names", ())))


def _plan(targets, count_key, per_image_keys):
    """(keys, counts, stacked names) if `targets` packs losslessly, else None."""
    if not isinstance(targets, (list, tuple)) or not targets:
        return None
    first = targets[0]
    if not isinstance(first, Mapping) or not first:
        return None
    keys = list(first)
    keyset = set(keys)
    for target in targets:
        if not isinstance(target, Mapping) or target.keys() != keyset:
            return None
    for key in keys:
        ref = first[key]
        if not _packable(ref):
            return None
        for target in targets:
            value = target[key]
            # torch.cat promotes mixed dtypes instead of failing (COCO: float32
            # area/iscrowd for an image without annotations, int64 otherwise).
            if not _packable(value) or value.dtype != ref.dtype or value.device != ref.device:
                return None

    if count_key is None:
        count_key = next((k for k in COUNT_KEYS if k in keyset), None)
        if count_key is None:
            count_key = next((k for k in keys if k not in per_image_keys and first[k].dim() >= 1),
                             None)
    if count_key is not None:
        if count_key not in keyset or any(t[count_key].dim() == 0 for t in targets):
            return None
        counts = [t[count_key].shape[0] for t in targets]
    else:
        counts = [0] * len(targets)

    stacked = set()
    for key in keys:
        shapes = [t[key].shape for t in targets]
        same_shape = all(s == shapes[0] for s in shapes)
        # Instance rows: dim 0 is the sample's count and the rest agrees, so
        # torch.cat cannot pad, broadcast or (legacy rule) skip a 1-D empty tensor.
        per_instance = count_key is not None and all(
            len(s) >= 1 and s[0] == c and s[1:] == shapes[0][1:] for s, c in zip(shapes, counts))
        if key in per_image_keys and same_shape:
            stacked.add(key)
        elif per_instance:
            continue
        elif same_shape and key != count_key:
            stacked.add(key)
        else:
            return None  # e.g. masks at different H×W: concatenating would need padding
    return keys, counts, stacked


def _empty_rows(rows: int, like: torch.Tensor) -> torch.Tensor:
    """Uninitialised [rows, *like.shape[1:]] on like's device (in the slot on CPU)."""
    shape = (rows, *like.shape[1:])
    if like.device.type == "cpu":
        return slot_empty(shape, like.dtype)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def pack_targets(targets, *, count_key: str | None = None, per_image_keys=PER_IMAGE_KEYS):
    """Pack a list (or tuple) of per-sample target dicts into a `PackedTargets`.

    Instance count: dim 0 of `count_key` (default: "labels", else "boxes", else
    the first field not in `per_image_keys` with at least one dimension). A
    field whose dim 0 equals the count in every sample (and whose other
    dimensions agree) is concatenated; a field with the same shape in every
    sample is stacked; names in `per_image_keys` are stacked whenever they can be.
    (So a fixed-size field outside `per_image_keys` whose length happens to equal
    every sample's count is concatenated in that batch; per-sample access is
    exact either way, only the layout of `fields` differs.)

    Returns `targets` itself, unchanged, when packing could lose anything:
      * it is not a list or tuple, is empty, or an element is not a mapping;
      * samples disagree on keys;
      * a value is not a plain `torch.Tensor` (numbers, strings, tensor
        subclasses such as tv_tensors or Parameters), is sparse or otherwise
        non-strided, quantized (always: torch.cat would requantize to the first
        sample's scale/zero_point), nested, named, or requires grad;
      * a field's dtype or device differs between samples (torch.cat would
        promote: COCO's float32 area/iscrowd for an image without annotations);
      * a field fits neither kind, e.g. masks whose H×W differ between samples
        (concatenation would need padding) or boxes of shape [0] next to [N, 4].

    In a PoolLoader worker the packed fields are allocated in the slot
    (`slot_empty`), so they are written once. Cost: one pass over the targets'
    bytes.
    """
    plan = _plan(targets, count_key, per_image_keys)
    if plan is None:
        return targets
    keys, counts, stacked = plan
    batch = len(targets)
    total = sum(counts)
    fields = {}
    for key in keys:
        column = [t[key] for t in targets]
        if key in stacked:
            out = _empty_rows(batch, column[0].unsqueeze(0))
            fields[key] = torch.stack(column, 0, out=out)
        else:
            fields[key] = torch.cat(column, 0, out=_empty_rows(total, column[0]))
    count_tensor = slot_empty((batch,), torch.int64)
    count_tensor.copy_(torch.tensor(counts, dtype=torch.int64))
    return PackedTargets._unchecked(fields, count_tensor, frozenset(stacked), _offsets(counts))


class DetectionCollate:
    """collate_fn for `(image [C,H,W], target dict)` samples -> `(images, mask, targets)`.

    images  [B, C, Hmax, Wmax], each image at the top-left, padding zero-filled;
    mask    bool [B, Hmax, Wmax], True on padding (RF-DETR's NestedTensor mask);
    targets with pack=True `pack_targets(tuple of dicts)`: a PackedTargets, or the
            tuple of dicts when it cannot pack losslessly; with pack=False the tuple.

    Images and mask are allocated with `slot_empty`: in a PoolLoader worker they
    are written straight into the slot. Target masks are left at each sample's
    own H×W (they are per-instance at the sample's size); if those differ within
    a batch, packing falls back. Images must share channels, dtype and device.
    Picklable (spawn / forkserver workers).
    """

    def __init__(self, pack: bool = True):
        self.pack = pack

    def __call__(self, batch):
        if not batch:
            raise ValueError("DetectionCollate got an empty batch")
        images, targets = [], []
        for sample in batch:
            image, target = sample
            images.append(image)
            targets.append(target)
        ref = images[0]
        for i, image in enumerate(images):
            if (not isinstance(image, torch.Tensor) or image.dim() != 3
                    or image.shape[0] != ref.shape[0] or image.dtype != ref.dtype
                    or image.device != ref.device):
                raise TypeError(
                    f"DetectionCollate: image {i} is {_describe(image)}; every image must be a "
                    f"[C, H, W] tensor like image 0 ({_describe(ref)})")
        channels = ref.shape[0]
        hmax = max(image.shape[1] for image in images)
        wmax = max(image.shape[2] for image in images)
        b = len(images)
        if ref.device.type == "cpu":
            out = slot_empty((b, channels, hmax, wmax), ref.dtype)
            mask = slot_empty((b, hmax, wmax), torch.bool)
        else:
            out = torch.empty((b, channels, hmax, wmax), dtype=ref.dtype, device=ref.device)
            mask = torch.empty((b, hmax, wmax), dtype=torch.bool, device=ref.device)
        mask.fill_(True)
        for i, image in enumerate(images):
            h, w = image.shape[1], image.shape[2]
            out[i, :, :h, :w].copy_(image)
            if h < hmax:
                out[i, :, h:, :].zero_()
            if w < wmax:
                out[i, :, :h, w:].zero_()
            mask[i, :h, :w] = False
        targets = tuple(targets)  # the fallback and pack=False give the same type
        packed = pack_targets(targets) if self.pack else targets
        return out, mask, packed

    def __repr__(self) -> str:
        return f"DetectionCollate(pack={self.pack})"
