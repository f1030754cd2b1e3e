"""fixtures.cache / cached_coco_like: the per-user data cache trusts nothing it finds.

Each test points XDG_CACHE_HOME at its own tmp_path, so the user's real cache
is never touched. The data sets are tiny (3 images).
"""
import json
import os

import pytest

from fixtures import cache, synthetic
from fixtures.synthetic import cached_coco_like, make_coco_like

IMAGES, SEED = 3, 11


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "poolloader"


def _generations(monkeypatch):
    """Count calls of make_coco_like made through cached_coco_like."""
    calls = []
    real = synthetic.make_coco_like

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "make_coco_like", counting)
    return calls


def test_cache_is_private_verified_and_reused(xdg, monkeypatch):
    calls = _generations(monkeypatch)
    root, ann = cached_coco_like(IMAGES, SEED)
    assert os.path.dirname(root) == str(xdg)
    assert os.stat(xdg).st_mode & 0o777 == 0o700
    assert os.stat(root).st_mode & 0o777 == 0o700
    with open(os.path.join(root, cache.MANIFEST)) as f:
        manifest = json.load(f)
    with open(ann) as f:
        names = {im["file_name"] for im in json.load(f)["images"]}
    assert set(manifest["files"]) == names | {"annotations.json"}
    assert manifest["params"] == synthetic.coco_like_params(IMAGES, SEED)
    assert cached_coco_like(IMAGES, SEED) == (root, ann)
    assert len(calls) == 1  # the second call verified and reused it
    assert [n for n in os.listdir(xdg) if n.startswith(".")] == []  # no staging left


@pytest.mark.parametrize("tamper", ["flip_a_byte", "remove_image", "swap_manifest_params",
                                    "no_manifest"])
def test_a_tampered_cache_is_regenerated(xdg, monkeypatch, tamper):
    root, ann = cached_coco_like(IMAGES, SEED)
    image = os.path.join(root, sorted(n for n in os.listdir(root) if n.endswith(".jpg"))[0])
    with open(image, "rb") as f:
        original = f.read()
    manifest = os.path.join(root, cache.MANIFEST)
    if tamper == "flip_a_byte":
        with open(image, "r+b") as f:
            f.seek(len(original) // 2)
            f.write(bytes([original[len(original) // 2] ^ 0xFF]))
    elif tamper == "remove_image":
        os.unlink(image)
    elif tamper == "swap_manifest_params":
        with open(manifest) as f:
            m = json.load(f)
        m["params"]["seed"] = SEED + 1
        with open(manifest, "w") as f:
            json.dump(m, f)
    else:
        os.unlink(manifest)
    assert cache.verified(root, synthetic.coco_like_params(IMAGES, SEED)) is not None
    calls = _generations(monkeypatch)
    assert cached_coco_like(IMAGES, SEED) == (root, ann)
    assert len(calls) == 1
    assert cache.verified(root, synthetic.coco_like_params(IMAGES, SEED)) is None
    with open(image, "rb") as f:
        assert f.read() == original  # same seed, same bytes
    assert sorted(os.listdir(xdg)) == [os.path.basename(root)]  # the bad copy is gone


def test_a_symlinked_image_is_not_trusted(xdg, tmp_path):
    root, _ = cached_coco_like(IMAGES, SEED)
    image = os.path.join(root, sorted(n for n in os.listdir(root) if n.endswith(".jpg"))[0])
    elsewhere = tmp_path / "elsewhere.jpg"
    os.rename(image, elsewhere)
    os.symlink(elsewhere, image)  # same bytes, but not a file of the data set
    problem = cache.verified(root, synthetic.coco_like_params(IMAGES, SEED))
    assert problem is not None and "not a regular file" in problem


@pytest.mark.parametrize("bad", ["group_writable", "other_owner", "symlink"])
def test_a_cache_folder_others_can_touch_is_refused(xdg, tmp_path, bad):
    if bad == "other_owner" and os.geteuid() != 0:
        pytest.skip("changing a folder's owner needs root")
    os.makedirs(xdg.parent, exist_ok=True)
    if bad == "symlink":
        target = tmp_path / "target"
        os.mkdir(target, 0o700)
        os.symlink(target, xdg)
    else:
        os.mkdir(xdg, 0o700)
        if bad == "group_writable":
            os.chmod(xdg, 0o770)
        else:
            os.chown(xdg, os.geteuid() + 12345, -1)
    with pytest.raises(PermissionError, match=str(xdg)) as info:
        cached_coco_like(IMAGES, SEED)
    assert "XDG_CACHE_HOME" in str(info.value)
    target = tmp_path / "target" if bad == "symlink" else xdg
    assert os.listdir(target) == []  # nothing written there


def test_an_explicit_folder_is_generated_verified_and_never_deleted(tmp_path):
    data = tmp_path / "data"
    root, ann = cached_coco_like(IMAGES, SEED, str(data))
    assert root == str(data) and os.path.exists(ann)
    assert cached_coco_like(IMAGES, SEED, str(data)) == (root, ann)
    # a folder written by make_coco_like itself carries the same manifest
    made = tmp_path / "made"
    make_coco_like(str(made), IMAGES, SEED)
    assert cache.verified(str(made), synthetic.coco_like_params(IMAGES, SEED)) is None
    # someone else's folder: a clear error, and it is left as it was
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not the data set asked for"):
        cached_coco_like(IMAGES, SEED, str(foreign))
    assert os.listdir(foreign) == ["mine.txt"]
    with pytest.raises(ValueError, match="holds"):
        cached_coco_like(IMAGES, SEED + 1, str(data))  # another seed's folder
