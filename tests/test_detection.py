"""pack_targets / PackedTargets / DetectionCollate, the synthetic COCO data, and both
through real PoolLoader workers against torch's DataLoader."""
from __future__ import annotations

import collections
import collections.abc
import io
import json
import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch
from compare import assert_same, lockstep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import DataLoader

from fixtures.synthetic import CocoLikeDataset, FilledDetectionDataset, make_coco_like
from poolloader import PoolLoader
from poolloader.detection import DetectionCollate, PackedTargets, pack_targets
from poolloader.shm.backend import PAGE
from poolloader.wire import slot_format as fmt

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")


# -- helpers ---------------------------------------------------------------------------------

def assert_exact(a, b, path="x"):
    """The tests' comparator (tests/compare.py), without the memory-layout check."""
    assert_same(a, b, path, strides=False)


def assert_round_trip(packed, originals):
    """Every sample comes back equal to its original dict, as views of the packed fields."""
    assert isinstance(packed, PackedTargets), type(packed)
    assert len(packed) == len(originals)
    for i, (got, want) in enumerate(zip(packed.as_list(), originals)):
        assert set(got) == set(want), i
        assert_exact({k: got[k] for k in want}, dict(want), f"sample{i}")
        for key, value in got.items():
            field = packed.fields[key]
            assert value.untyped_storage().data_ptr() == field.untyped_storage().data_ptr(), \
                f"sample{i}[{key!r}] is a copy, not a view of the packed field"
        assert_exact(packed[i], got, f"packed[{i}]")
        assert_exact(packed[i - len(packed)], got, f"packed[{i - len(packed)}]")
    assert_exact(list(packed), packed.as_list(), "iter")


def tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, PackedTargets):
        yield obj.counts
        yield from obj.fields.values()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def coco_target(n, h=5, w=6, k=3, gen=None, image_id=0):
    gen = gen or torch.Generator().manual_seed(n * 31 + image_id)
    return {
        "boxes": torch.rand((n, 4), generator=gen),
        "labels": torch.randint(0, 91, (n,), generator=gen),
        "image_id": torch.tensor([image_id]),
        "area": torch.rand((n,), generator=gen) * 100,
        "iscrowd": torch.zeros(n, dtype=torch.int64),
        "orig_size": torch.tensor([480, 640]),
        "size": torch.tensor([h, w]),
        "masks": torch.rand((n, h, w), generator=gen) > 0.5,
        "keypoints": torch.rand((n, k, 3), generator=gen),
    }


# -- pack_targets round trip ---------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=7),
       hw=st.tuples(st.integers(1, 9), st.integers(1, 9)),
       k=st.integers(1, 4),
       scalar_id=st.booleans(),
       seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_pack_round_trips_exactly(counts, hw, k, scalar_id, seed, data):
    gen = torch.Generator().manual_seed(seed)
    targets = []
    for i, n in enumerate(counts):
        t = coco_target(n, *hw, k, gen, image_id=i)
        if scalar_id:
            t["image_id"] = torch.tensor(i)                  # 0-dim
        t["boxes"] = torch.rand((4, n), generator=gen).t()   # non-contiguous
        t["area"][: n // 2] = float("nan")                    # bits, not just ==
        if data.draw(st.booleans(), label=f"reorder keys of sample {i}"):
            t = dict(reversed(list(t.items())))
        targets.append(t)
    packed = pack_targets(targets)
    assert_round_trip(packed, targets)
    assert packed.counts.dtype == torch.int64 and packed.counts.tolist() == counts
    total = sum(counts)
    assert packed.fields["boxes"].shape == (total, 4)
    assert packed.fields["masks"].shape == (total, *hw)
    assert packed.fields["keypoints"].shape == (total, k, 3)
    assert packed.fields["image_id"].shape == ((len(counts),) if scalar_id else (len(counts), 1))
    assert packed.stacked == {"image_id", "orig_size", "size"}
    assert_exact(pickle.loads(pickle.dumps(packed)), packed)


def test_equal_counts_keep_the_same_layout():
    """Every sample with 2 instances: orig_size [2] still stacks, boxes still concatenate."""
    targets = [coco_target(2, image_id=i) for i in range(3)]
    packed = pack_targets(targets)
    assert_round_trip(packed, targets)
    assert packed.fields["boxes"].shape == (6, 4)
    assert packed.fields["orig_size"].shape == (3, 2)
    assert packed.fields["labels"].shape == (6,)


def test_all_empty_and_single_sample():
    for counts in ([0, 0, 0], [0], [5]):
        targets = [coco_target(n, image_id=i) for i, n in enumerate(counts)]
        assert_round_trip(pack_targets(targets), targets)


def test_fields_without_labels_or_boxes():
    targets = [{"points": torch.rand(n, 2), "id": torch.tensor(i)} for i, n in enumerate([3, 0, 2])]
    packed = pack_targets(targets)
    assert_round_trip(packed, targets)
    assert packed.counts.tolist() == [3, 0, 2] and packed.stacked == {"id"}


def test_packed_targets_is_not_a_sequence():
    packed = pack_targets([coco_target(1), coco_target(2)])
    assert not isinstance(packed, collections.abc.Sequence)
    assert not isinstance(packed, collections.abc.Mapping)
    with pytest.raises(IndexError):
        packed[2]
    assert_exact(packed[0:2], packed.as_list())


def test_views_share_the_packed_mask_field():
    """Materialising the batch never copies a mask field: one storage for all samples."""
    targets = [coco_target(n, 64, 48) for n in (3, 0, 5)]
    packed = pack_targets(targets)
    ptr = packed.fields["masks"].untyped_storage().data_ptr()
    nbytes = packed.fields["masks"].untyped_storage().nbytes()
    views = packed.as_list()
    assert {v["masks"].untyped_storage().data_ptr() for v in views} == {ptr}
    assert {v["masks"].untyped_storage().nbytes() for v in views} == {nbytes}
    views[2]["masks"][0, 0, 0] = not views[2]["masks"][0, 0, 0]  # a view writes through
    assert packed.fields["masks"][3, 0, 0] == views[2]["masks"][0, 0, 0]


def test_constructor_checks_the_layout():
    fields = {"boxes": torch.zeros(5, 4), "size": torch.zeros(2, 2, dtype=torch.int64)}
    packed = PackedTargets(fields, torch.tensor([2, 3]), stacked={"size"})
    assert [t["boxes"].shape for t in packed] == [(2, 4), (3, 4)]
    with pytest.raises(ValueError, match="'boxes'"):
        PackedTargets(fields, torch.tensor([2, 2]), stacked={"size"})
    with pytest.raises(ValueError, match="'size'"):
        PackedTargets(fields, torch.tensor([2, 3]))
    with pytest.raises(TypeError, match="int64"):
        PackedTargets(fields, torch.tensor([2.0, 3.0]), stacked={"size"})
    with pytest.raises(ValueError, match="not fields"):
        PackedTargets(fields, torch.tensor([2, 3]), stacked={"size", "nope"})


# -- fallbacks -------------------------------------------------------------------------------

def _quantized(scale, zero_point):
    with warnings.catch_warnings():  # quantized tensors are deprecated in recent torch
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.rand(3, 4), scale, zero_point, torch.quint8)


def _sparse_csr(t):
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore")
        return t.to_sparse_csr()


def _fallback_cases():
    a, b = coco_target(2, image_id=0), coco_target(3, image_id=1)
    zeros = torch.zeros(3)
    empty = coco_target(0, image_id=2)  # COCO: no annotations -> float32 from an empty list
    empty["iscrowd"] = torch.tensor([])
    return {
        "empty list": [],
        "empty tuple": (),
        "mixed dtypes (coco empty image)": [a, empty],
        "missing key": [a, {k: v for k, v in b.items() if k != "area"}],
        "extra key": [a, {**b, "extra": torch.zeros(3)}],
        "sparse coo": [{**a, "masks": a["masks"].to_sparse()},
                       {**b, "masks": b["masks"].to_sparse()}],
        "sparse in one sample": [a, {**b, "boxes": b["boxes"].to_sparse()}],
        "sparse csr": [{**a, "boxes": _sparse_csr(a["boxes"])},
                       {**b, "boxes": _sparse_csr(b["boxes"])}],
        "quantized, different scale": [{"labels": zeros, "q": _quantized(0.1, 3)},
                                       {"labels": zeros, "q": _quantized(0.2, 3)}],
        "quantized, different zero_point": [{"labels": zeros, "q": _quantized(0.1, 3)},
                                            {"labels": zeros, "q": _quantized(0.1, 9)}],
        "quantized, same params": [{"labels": zeros, "q": _quantized(0.1, 3)},
                                   {"labels": zeros, "q": _quantized(0.1, 3)}],
        "devices differ": [a, {**b, "labels": b["labels"].to("meta")}],
        "non-tensor value": [a, {**b, "image_id": 1}],
        "tensor subclass": [a, {**b, "boxes": torch.nn.Parameter(b["boxes"], requires_grad=False)}],
        "requires grad": [a, {**b, "boxes": b["boxes"].clone().requires_grad_()}],
        "mask H×W differ": [a, coco_target(3, h=7, w=6, image_id=1)],
        "1-D empty boxes next to [N,4]": [a, {**coco_target(0, image_id=1),
                                              "boxes": torch.zeros(0)}],
        "keypoints K differ": [a, coco_target(3, k=4, image_id=1)],
        "per-image field shape differs": [a, {**b, "orig_size": torch.tensor([1, 2, 3, 4])}],
        "element not a dict": [a, [("boxes", b["boxes"])]],
        "empty dicts": [{}, {}],
    }


@pytest.mark.parametrize("name", list(_fallback_cases()))
def test_pack_falls_back_unchanged(name):
    targets = _fallback_cases()[name]
    snapshot = pickle.dumps(targets)
    assert pack_targets(targets) is targets
    assert pickle.dumps(targets) == snapshot  # nothing touched


def test_collate_fallback_gives_the_tuple_of_dicts():
    a, b = coco_target(2, image_id=0), coco_target(3, h=7, image_id=1)
    images = [torch.rand(3, 5, 6), torch.rand(3, 7, 6)]
    _, _, targets = DetectionCollate()(list(zip(images, [a, b])))
    assert type(targets) is tuple and targets[0] is a and targets[1] is b


# -- moving ----------------------------------------------------------------------------------

def test_to_keeps_it_packed():
    targets = [coco_target(n, image_id=i) for i, n in enumerate([2, 0, 4])]
    packed = pack_targets(targets)
    moved = packed.to("cpu")
    assert isinstance(moved, PackedTargets)
    assert_exact(moved, packed)
    meta = packed.to("meta", non_blocking=True)
    assert isinstance(meta, PackedTargets) and len(meta) == 3
    assert meta.counts.device.type == "meta"
    assert all(v.device.type == "meta" for v in meta.fields.values())
    assert [t["boxes"].shape for t in meta] == [(2, 4), (0, 4), (4, 4)]


@needs_cuda
def test_pin_memory_keeps_it_packed():
    packed = pack_targets([coco_target(n, image_id=i) for i, n in enumerate([2, 0, 4])])
    pinned = packed.pin_memory()
    assert isinstance(pinned, PackedTargets) and pinned.is_pinned()
    assert_exact(pinned, packed)
    on_gpu = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert_exact(on_gpu.to("cpu"), packed)


@needs_cuda
def test_torch_pin_memory_helper_keeps_it_packed():
    from torch.utils.data._utils.pin_memory import pin_memory

    packed = pack_targets([coco_target(n, image_id=i) for i, n in enumerate([2, 0, 4])])
    batch = pin_memory((torch.rand(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.bool), packed))
    assert isinstance(batch[2], PackedTargets) and batch[2].is_pinned()
    assert_exact(batch[2], packed)


# -- DetectionCollate ------------------------------------------------------------------------

def test_collate_pads_images_and_builds_the_mask():
    gen = torch.Generator().manual_seed(0)
    sizes = [(5, 7), (9, 4), (9, 7), (1, 1)]
    images = [torch.rand((3, h, w), generator=gen) - 2 for h, w in sizes]
    targets = [coco_target(i, h, w, image_id=i) for i, (h, w) in enumerate(sizes)]
    images_out, mask, packed = DetectionCollate()(list(zip(images, targets)))
    assert images_out.shape == (4, 3, 9, 7) and images_out.dtype == torch.float32
    assert mask.shape == (4, 9, 7) and mask.dtype == torch.bool
    for i, (h, w) in enumerate(sizes):
        assert torch.equal(images_out[i, :, :h, :w], images[i])
        padding = torch.ones(9, 7, dtype=torch.bool)
        padding[:h, :w] = False
        assert torch.equal(mask[i], padding)
        assert (images_out[i][:, padding] == 0).all()
    # the masks fields disagree in H×W: targets fall back to the tuple
    assert type(packed) is tuple and all(p is t for p, t in zip(packed, targets))

    same = [coco_target(i, 4, 4, image_id=i) for i in range(4)]
    _, _, packed = DetectionCollate()(list(zip(images, same)))
    assert_round_trip(packed, same)
    _, _, unpacked = DetectionCollate(pack=False)(list(zip(images, same)))
    assert type(unpacked) is tuple and all(p is t for p, t in zip(unpacked, same))


def test_collate_rejects_mismatched_images():
    t = coco_target(1)
    with pytest.raises(TypeError, match="image 1"):
        DetectionCollate()([(torch.rand(3, 4, 4), t), (torch.rand(1, 4, 4), t)])
    with pytest.raises(TypeError, match="image 1"):
        DetectionCollate()([(torch.rand(3, 4, 4), t), (torch.rand(3, 4, 4).double(), t)])
    assert isinstance(pickle.loads(pickle.dumps(DetectionCollate(pack=False))), DetectionCollate)


# -- synthetic data --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def coco_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    return root, make_coco_like(root, 24, seed=7)


def test_make_coco_like_is_deterministic_and_photographic(coco_dir, tmp_path):
    root, ann = coco_dir
    again = make_coco_like(tmp_path / "again", 24, seed=7)
    with open(ann) as f, open(again) as g:
        coco, coco2 = json.load(f), json.load(g)
    assert coco["images"] == coco2["images"] and coco["annotations"] == coco2["annotations"]
    for im in coco["images"]:
        with open(os.path.join(root, im["file_name"]), "rb") as f, \
                open(tmp_path / "again" / im["file_name"], "rb") as g:
            assert f.read() == g.read(), im["file_name"]
    with open(make_coco_like(tmp_path / "other", 3, seed=8)) as f:
        assert json.load(f)["annotations"] != [a for a in coco["annotations"] if a["image_id"] <= 3]

    per_image = collections.Counter(a["image_id"] for a in coco["annotations"])
    counts = [per_image.get(im["id"], 0) for im in coco["images"]]
    assert 4.0 <= sum(counts) / len(counts) <= 10.0, counts
    assert 0 in counts, counts
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        assert w > 0 and h > 0 and 0 <= x and x + w <= 640.01 and 0 <= y and y + h <= 480.01
        assert len(a["segmentation"][0]) >= 10 and a["area"] > 0 and a["iscrowd"] == 0
        assert len(a["keypoints"]) == 15
    assert {c["id"] for c in coco["categories"]} >= {a["category_id"] for a in coco["annotations"]}
    pixels = np.asarray(Image.open(os.path.join(root, coco["images"][0]["file_name"])))
    assert pixels.shape == (480, 640, 3)
    assert pixels.std() > 20  # not flat
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20_000  # photographic entropy


def test_coco_like_dataset_items(coco_dir):
    root, ann = coco_dir
    ds = CocoLikeDataset(root, ann, resolution=96, masks=True, keypoints=True)
    plain = CocoLikeDataset(root, ann, resolution=96, masks=True, keypoints=True, augment=False)
    random.seed(3)
    seen_flip = set()
    for i in range(len(ds)):
        image, t = ds[i]
        assert image.shape == (3, 96, 96) and image.dtype == torch.float32
        n = t["labels"].shape[0]
        expect = {"boxes": (torch.float32, (n, 4)), "labels": (torch.int64, (n,)),
                  "image_id": (torch.int64, (1,)), "area": (torch.float32, (n,)),
                  "iscrowd": (torch.int64, (n,)), "orig_size": (torch.int64, (2,)),
                  "size": (torch.int64, (2,)), "masks": (torch.bool, (n, 96, 96)),
                  "keypoints": (torch.float32, (n, 5, 3))}
        assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == expect
        assert t["orig_size"].tolist() == [480, 640] and t["size"].tolist() == [96, 96]
        assert t["image_id"].item() == i + 1
        assert ((t["boxes"] >= 0) & (t["boxes"] <= 1)).all()
        if n:
            assert t["masks"].flatten(1).any(1).all()  # every instance has pixels
            _, u = plain[i]
            flipped = not torch.equal(t["masks"], u["masks"])
            if flipped:
                assert torch.equal(t["masks"], u["masks"].flip(-1)) or \
                    (t["masks"] ^ u["masks"].flip(-1)).float().mean() < 0.02
                torch.testing.assert_close(t["boxes"][:, 0], 1 - u["boxes"][:, 0])
            else:
                assert_exact(t, u)
            seen_flip.add(flipped)
    assert seen_flip == {True, False}  # the flip happens, and not always

    # deterministic given the RNG state, and picklable
    clone = pickle.loads(pickle.dumps(ds))
    random.seed(11)
    a = [ds[i] for i in range(4)]
    random.seed(11)
    assert_exact([clone[i] for i in range(4)], a)

    multi = CocoLikeDataset(root, ann, multiscale=(64, 80, 96), augment=False)
    random.seed(0)
    sizes = {multi[i % len(multi)][0].shape[1] for i in range(30)}
    assert sizes == {64, 80, 96}


def test_filled_dataset_is_deterministic():
    ds = FilledDetectionDataset(40, resolution=32, instances=3, seed=5, masks=True, keypoints=True)
    assert_exact([ds[i] for i in range(40)], [ds[i] for i in range(40)])
    counts = [ds[i][1]["labels"].shape[0] for i in range(40)]
    assert 0 in counts and max(counts) <= 6 and 1.5 <= sum(counts) / 40 <= 4.5
    image, t = ds[0]
    assert image.shape == (3, 32, 32) and t["masks"].shape[1:] == (32, 32)
    assert set(t) == {"boxes", "labels", "image_id", "area", "iscrowd", "orig_size", "size",
                      "masks", "keypoints"}
    sized = FilledDetectionDataset(20, sizes=[16, (8, 24)])
    assert {tuple(sized[i][0].shape[1:]) for i in range(20)} == {(16, 16), (8, 24)}


# -- through real workers --------------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("options", [dict(masks=True, keypoints=True),
                                     dict(masks=True, multiscale=(96, 112, 128))],
                         ids=["packed", "multiscale-fallback"])
def test_jpeg_pipeline_matches_dataloader(coco_dir, options):
    root, ann = coco_dir
    ds = CocoLikeDataset(root, ann, resolution=128, **options)
    kw = dict(batch_size=4, shuffle=True, num_workers=2, collate_fn=DetectionCollate(),
              timeout=60)
    ref = DataLoader(ds, generator=torch.Generator().manual_seed(5), **kw)
    got = PoolLoader(ds, generator=torch.Generator().manual_seed(5), **kw)
    batches = packed = 0
    for a, b in lockstep(ref, got):
        assert_exact(a, b, f"batch{batches}")
        for t in tensors_of(b):  # a batch the user owns: each slot tensor has its own storage
            if t.nbytes > fmt.SMALL_TENSOR_BYTES:
                assert t.untyped_storage().nbytes() == t.nbytes, "one storage per tensor"
        packed += isinstance(b[2], PackedTargets)
        batches += 1
    assert batches == 6
    if "multiscale" in options:
        assert packed < batches  # masks of different sizes in a batch: the fallback travelled
    else:
        assert packed == batches


@pytest.mark.timeout(90)
def test_spawn_workers_carry_the_pipeline(coco_dir):
    root, ann = coco_dir
    ds = CocoLikeDataset(root, ann, resolution=64, masks=True, augment=False)
    ref = DataLoader(ds, batch_size=4, collate_fn=DetectionCollate())
    got = PoolLoader(ds, batch_size=4, collate_fn=DetectionCollate(), num_workers=1,
                     multiprocessing_context="spawn", timeout=60)
    for a, b in lockstep(ref, got):
        assert_exact(a, b)


RANDOM_SIZES = [64, 96, (128, 200), 256, (300, 180), (40, 333)]


def _random_size_dataset():
    return FilledDetectionDataset(800, sizes=RANDOM_SIZES, instances=7, seed=3, keypoints=True)


@pytest.mark.timeout(120)
def test_random_sizes_200_batches_match_dataloader():
    ds = _random_size_dataset()
    kw = dict(batch_size=4, num_workers=2, collate_fn=DetectionCollate(), timeout=60)
    ref = DataLoader(ds, **kw)
    got = PoolLoader(ds, slot_bytes=fmt.MIN_SLOT_BYTES, **kw)
    n = 0
    for a, b in lockstep(ref, got):
        assert_exact(a, b, f"batch{n}")
        assert isinstance(b[2], PackedTargets)
        n += 1
    assert n == 200
    assert got.stats.batches == 200 and got.stats.slot_growths >= 1


def _slot_need(batch) -> int:
    """Bytes a batch takes in a slot: each tensor 64-byte aligned, plus its skeleton (the
    batch pickled with a small persistent id per tensor), plus the header/request area."""
    class Skeleton(pickle.Pickler):
        def persistent_id(self, obj):
            if type(obj) is torch.Tensor:
                return (1, 0, 1 << 40, tuple(obj.shape), obj.stride())
            return None

    buf = io.BytesIO()
    Skeleton(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(batch)
    data = sum(fmt.align64(t.nbytes)
               for t in tensors_of(batch))
    return fmt.DATA_OFF + data + len(buf.getvalue())


@pytest.mark.timeout(120)
def test_slot_size_stays_bounded():
    ds = _random_size_dataset()
    loader = PoolLoader(ds, batch_size=4, num_workers=2, collate_fn=DetectionCollate(),
                        slot_bytes=fmt.MIN_SLOT_BYTES, timeout=60)
    largest = slot_bytes = 0
    n = 0
    for batch in loader:
        largest = max(largest, _slot_need(batch))
        slot_bytes = max(slot_bytes, loader.stats.slot_bytes)
        n += 1
        del batch
    assert n == 200
    bound = 1.25 * largest + 64 * 1024 + PAGE
    assert slot_bytes <= bound, f"slot grew to {slot_bytes} bytes; largest batch needs {largest}"
