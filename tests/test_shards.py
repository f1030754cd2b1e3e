"""fixtures.shards: the tar shard writer (layout, atomicity, name checks) and the
decoding helper's bit-for-bit agreement with CocoLikeDataset."""
from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
import torch

from fixtures import shards
from fixtures.shards import DecodeSample, decode_sample, read_index, read_samples, shard_urls, write_shards
from fixtures.synthetic import CocoLikeDataset, make_coco_like

SHARD_BYTES = 30_720  # three tar records: ~2-4 small samples per shard


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    ann = make_coco_like(root, 14, seed=21, size=(96, 72))
    return str(root), ann


def _tree_digest(path):
    """{relative path: sha256} of every file under `path`."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_layout_counts_and_original_bytes(coco, tmp_path):
    root, ann = coco
    index = write_shards(root, ann, tmp_path / "out", split="train", shard_bytes=SHARD_BYTES)
    with open(ann) as f:
        meta = json.load(f)
    assert sorted(os.listdir(tmp_path / "out")) == ["train"]  # no staging left behind
    assert index == read_index(tmp_path / "out", "train")
    assert index["num_samples"] == len(meta["images"]) == sum(s["num_samples"] for s in index["shards"])
    assert len(index["shards"]) >= 4
    assert index["categories"] == meta["categories"]
    by_image = {im["id"]: [] for im in meta["images"]}
    for a in meta["annotations"]:
        by_image[a["image_id"]].append(a)
    seen = []
    for shard, url in zip(index["shards"], shard_urls(tmp_path / "out", "train")):
        assert os.path.basename(url) == shard["name"] and shard["name"].startswith("train-")
        assert os.path.getsize(url) == shard["bytes"]
        samples = list(read_samples(url))
        assert len(samples) == shard["num_samples"] >= 1
        assert shard["bytes"] <= SHARD_BYTES or len(samples) == 1
        for s in samples:
            assert sorted(k for k in s if not k.startswith("__")) == ["jpg", "json"]
            info = json.loads(s["json"])
            with open(os.path.join(root, info["file_name"]), "rb") as f:
                assert s["jpg"] == f.read()  # the original bytes, never re-encoded
            assert s["__key__"] == info["file_name"].rsplit(".", 1)[0]
            assert info["annotations"] == by_image[info["image_id"]]
            seen.append(info["image_id"])
    assert seen == sorted(by_image)  # image-id order, like CocoLikeDataset


def test_same_input_same_shard_bytes(coco, tmp_path):
    root, ann = coco
    write_shards(root, ann, tmp_path / "a", shard_bytes=SHARD_BYTES)
    write_shards(root, ann, tmp_path / "b", shard_bytes=SHARD_BYTES)
    assert _tree_digest(tmp_path / "a") == _tree_digest(tmp_path / "b")


def test_one_big_shard_and_one_sample_per_shard(coco, tmp_path):
    root, ann = coco
    big = write_shards(root, ann, tmp_path, split="big")
    tiny = write_shards(root, ann, tmp_path, split="tiny", shard_bytes=1)
    assert [s["num_samples"] for s in big["shards"]] == [14]
    assert [s["num_samples"] for s in tiny["shards"]] == [1] * 14


@pytest.mark.parametrize("options", [
    dict(resolution=48),
    dict(resolution=40, masks=True, keypoints=True),
    dict(multiscale=(32, 48), masks=True),
    dict(resolution=48, augment=False),
])
def test_decode_sample_matches_coco_like_dataset_bit_for_bit(coco, tmp_path, options):
    root, ann = coco
    write_shards(root, ann, tmp_path, shard_bytes=SHARD_BYTES)
    dataset = CocoLikeDataset(root, ann, **options)
    random.seed(3)
    expected = [dataset[i] for i in range(len(dataset))]
    decode = DecodeSample(**options)
    random.seed(3)
    got = [decode(s) for url in shard_urls(tmp_path) for s in read_samples(url)]
    assert _equal(got, expected)
    assert sum(t["boxes"].shape[0] for _, t in got) > 0


def test_decode_sample_accepts_webdataset_decoded_samples(coco, tmp_path):
    wds = pytest.importorskip("webdataset")
    root, ann = coco
    write_shards(root, ann, tmp_path, shard_bytes=SHARD_BYTES)
    dataset = CocoLikeDataset(root, ann, resolution=40, masks=True)
    random.seed(9)
    expected = [dataset[i] for i in range(len(dataset))]
    for spec in ("pil", "rgb8"):
        # WebDataset() draws its default seed from `random`: build it before seeding
        pipeline = wds.WebDataset(shard_urls(tmp_path), shardshuffle=False).decode(spec)
        random.seed(9)
        got = [decode_sample(s, resolution=40, masks=True) for s in pipeline]
        assert _equal(got, expected), spec


# -- atomicity -----------------------------------------------------------------------------

def test_missing_image_leaves_nothing(coco, tmp_path):
    root, ann = coco
    with open(ann) as f:
        meta = json.load(f)
    meta["images"][9]["file_name"] = "does_not_exist.jpg"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(meta))
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError):
        write_shards(root, bad, out, shard_bytes=SHARD_BYTES)
    assert os.listdir(out) == []  # no split, no staging directory


class Injected(Exception):
    pass


@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt])
def test_failed_repack_mid_shard_keeps_the_old_split(coco, tmp_path, monkeypatch, error):
    root, ann = coco
    out = tmp_path / "out"
    write_shards(root, ann, out, shard_bytes=SHARD_BYTES)
    before = _tree_digest(out)
    real_add = shards._add_member
    calls = []

    def failing_add(tar, name, data):
        calls.append(name)
        if len(calls) == 11:  # a .jpg in the middle of a later shard
            raise error("injected")
        real_add(tar, name, data)

    monkeypatch.setattr(shards, "_add_member", failing_add)
    with pytest.raises(error):
        write_shards(root, ann, out, shard_bytes=SHARD_BYTES // 2)
    assert _tree_digest(out) == before
    assert sorted(os.listdir(out)) == ["train"]


def test_failed_publish_restores_the_old_split(coco, tmp_path, monkeypatch):
    root, ann = coco
    out = tmp_path / "out"
    write_shards(root, ann, out, shard_bytes=SHARD_BYTES)
    before = _tree_digest(out)
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(os.fspath(src)).startswith(".train.tmp-"):
            raise OSError("injected: rename of the staged split failed")
        real_rename(src, dst)

    monkeypatch.setattr(shards.os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        write_shards(root, ann, out, shard_bytes=SHARD_BYTES // 2)
    monkeypatch.undo()
    assert _tree_digest(out) == before
    assert sorted(os.listdir(out)) == ["train"]


def test_successful_repack_replaces_the_split(coco, tmp_path):
    root, ann = coco
    out = tmp_path / "out"
    first = write_shards(root, ann, out, shard_bytes=SHARD_BYTES)
    second = write_shards(root, ann, out, shard_bytes=1)
    assert len(second["shards"]) == 14 != len(first["shards"])
    assert sorted(os.listdir(out)) == ["train"]
    assert sorted(os.listdir(out / "train")) == sorted(
        ["index.json"] + [s["name"] for s in second["shards"]])


# -- names that would escape out_dir ---------------------------------------------------------

@pytest.mark.parametrize("split", ["../escape", "/tmp/abs", "a/b", "a\\b", "..", ".", "", ".hidden",
                                   "x\0y"])
def test_bad_split_names_are_rejected(coco, tmp_path, split):
    root, ann = coco
    out = tmp_path / "inner" / "out"
    with pytest.raises(ValueError, match="split"):
        write_shards(root, ann, out, split=split)
    assert sorted(os.listdir(tmp_path)) == []  # not even out_dir was created
    with pytest.raises(ValueError, match="split"):
        read_index(out, split)


@pytest.mark.parametrize("file_name", ["../escape.jpg", "/etc/abs.jpg", "sub/dir.jpg", "a\\b.jpg",
                                       "two.dots.jpg", ".jpg", "noext", "image.gif"])
def test_bad_keys_are_rejected(coco, tmp_path, file_name):
    root, ann = coco
    with open(ann) as f:
        meta = json.load(f)
    meta["images"][3]["file_name"] = file_name
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="file_name"):
        write_shards(root, bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_duplicate_keys_orphans_and_unknown_categories_are_rejected(coco, tmp_path):
    root, ann = coco
    with open(ann) as f:
        meta = json.load(f)
    cases = {
        "same sample key": lambda m: m["images"][4].update(
            file_name=m["images"][2]["file_name"].replace(".jpg", ".png")),
        "refer to no image": lambda m: m["annotations"].append(
            dict(m["annotations"][0], id=10**6, image_id=10**6)),
        "not among the categories": lambda m: m["annotations"][0].update(category_id=999),
        "lacks bbox": lambda m: m["annotations"][0].pop("bbox"),
    }
    for message, edit in cases.items():
        bad_meta = json.loads(json.dumps(meta))
        edit(bad_meta)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(bad_meta))
        with pytest.raises(ValueError, match=message):
            write_shards(root, bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shard_bytes", [0, -1, 1.5, True, None])
def test_bad_shard_bytes(coco, tmp_path, shard_bytes):
    root, ann = coco
    with pytest.raises(ValueError, match="shard_bytes"):
        write_shards(root, ann, tmp_path, shard_bytes=shard_bytes)


def test_crafted_index_cannot_point_outside(coco, tmp_path):
    root, ann = coco
    write_shards(root, ann, tmp_path, shard_bytes=SHARD_BYTES)
    path = tmp_path / "train" / "index.json"
    index = json.loads(path.read_text())
    index["shards"][0]["name"] = "../../outside.tar"
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard name"):
        shard_urls(tmp_path)
