"""Tar shards in WebDataset's layout for the synthetic COCO-like data set.

* `write_shards` packs a COCO-format split (the JPEGs under `root` and its
  annotation file) into `out_dir/<split>/<split>-000000.tar, ...` of about
  `shard_bytes` each, plus `out_dir/<split>/index.json` with every shard's
  sample count. Each sample is three tar members sharing one key: the
  original image bytes (`<key>.jpg`, or `.png`; never re-encoded) and
  `<key>.json` (image_id, file_name, width, height and the image's COCO
  annotations, unchanged). A WebDataset shard is an ordinary tar whose members
  are grouped by basename, so writing needs only the standard library; only
  reading them through `webdataset.WebDataset` needs that package.
* `decode_sample` / `DecodeSample` turn such a sample (raw, or after
  WebDataset's `.decode("pil")`) into the `(image, target)` that
  `poolloader.synthetic.CocoLikeDataset` returns for the same image: the same
  function builds both (`synthetic.build_sample`), so for the same Python
  `random` state they are equal bit for bit.
* `read_index` / `shard_urls` read the index back; `read_samples` reads a
  shard's samples without WebDataset (standard library only).

Packing is all or nothing: everything is written into a fresh temporary
directory inside `out_dir` and renamed into place only once every image was
read and every shard and the index were written and flushed. A failure (a
missing image, an annotation without a known image, a full disk, an
interrupt) removes the temporary directory and leaves an existing split as it
was. Names that would put a file outside `out_dir` (a split or key that is
absolute, `..`, or holds a path separator) are a ValueError before anything
is written.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
import uuid

from poolloader.synthetic import annotation_record, build_sample

INDEX_NAME = "index.json"
FORMAT = "poolloader-shards"
VERSION = 1
# Image extensions a sample may carry, as stored in the tar (".jpeg" is stored as "jpg").
IMAGE_EXTENSIONS = {"jpg": "jpg", "jpeg": "jpg", "png": "png"}
_BLOCK = 512
_END_OF_ARCHIVE = 2 * _BLOCK


def _check_name(name, what: str, *, allow_dots: bool) -> str:
    """`name` if it can only ever name one entry directly inside a directory, else ValueError."""
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a string, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError(f"{what} must not be empty")
    if "\0" in name:
        raise ValueError(f"{what} {name!r} contains a NUL byte")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if os.path.isabs(name) or any(sep in name for sep in seps):
        raise ValueError(f"{what} {name!r} is a path (absolute, or holds a separator); it must be "
                         "a plain name that stays inside the output directory")
    if name in (".", "..") or name.startswith("."):
        raise ValueError(f"{what} {name!r} must not start with '.' (it could name the output "
                         "directory's parent, itself, or a hidden staging directory)")
    if not allow_dots and "." in name:
        raise ValueError(f"{what} {name!r} must not contain '.': WebDataset splits a member name "
                         "into key and extension at the first dot")
    return name


def _sample_key(file_name) -> tuple[str, str]:
    """(key, stored extension) for an image's `file_name`: the name without its extension."""
    if not isinstance(file_name, str) or "." not in file_name:
        raise ValueError(f"image file_name {file_name!r} has no extension")
    stem, ext = file_name.rsplit(".", 1)
    stored = IMAGE_EXTENSIONS.get(ext.lower())
    if stored is None:
        raise ValueError(f"image file_name {file_name!r}: extension {ext!r} is not one of "
                         f"{sorted(IMAGE_EXTENSIONS)}")
    return _check_name(stem, f"sample key (from file_name {file_name!r})", allow_dots=False), stored


def _member_bytes(nbytes: int) -> int:
    return _BLOCK + -(-nbytes // _BLOCK) * _BLOCK


def _shard_file_bytes(members: int) -> int:
    """Size of a tar file holding `members` bytes of headers and data: tarfile
    ends it with two zero blocks and pads it to a whole record."""
    return -(-(members + _END_OF_ARCHIVE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o444
    info.mtime = 0  # same input, same shard bytes
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_split(ann_file):
    with open(ann_file) as f:
        coco = json.load(f)
    images = sorted(coco["images"], key=lambda im: im["id"])
    by_id = {}
    for im in images:
        if im["id"] in by_id:
            raise ValueError(f"{ann_file}: image id {im['id']} appears twice")
        by_id[im["id"]] = []
    category_ids = {c["id"] for c in coco.get("categories", [])}
    orphans = []
    for ann in coco.get("annotations", []):
        if "bbox" not in ann or "category_id" not in ann:
            raise ValueError(f"{ann_file}: annotation {ann.get('id')!r} lacks bbox or category_id")
        if category_ids and ann["category_id"] not in category_ids:
            raise ValueError(f"{ann_file}: annotation {ann.get('id')!r} has category_id "
                             f"{ann['category_id']!r}, which is not among the categories")
        if ann.get("image_id") not in by_id:
            orphans.append(ann.get("id"))
            continue
        by_id[ann["image_id"]].append(ann)
    if orphans:
        raise ValueError(f"{ann_file}: {len(orphans)} annotation(s) refer to no image "
                         f"(ids {orphans[:5]}{'...' if len(orphans) > 5 else ''})")
    keys = {}
    plan = []
    for im in images:
        key, ext = _sample_key(im["file_name"])
        if key in keys:
            raise ValueError(f"{ann_file}: images {keys[key]!r} and {im['file_name']!r} "
                             f"give the same sample key {key!r}")
        keys[key] = im["file_name"]
        plan.append((key, ext, im, by_id[im["id"]]))
    return coco, plan


def write_shards(root, ann_file, out_dir, split: str = "train",
                 shard_bytes: int = 100_000_000) -> dict:
    """Pack `root` + `ann_file` (COCO format) into WebDataset tar shards; returns the index.

    Writes `out_dir/<split>/<split>-NNNNNN.tar` and `out_dir/<split>/index.json`
    (replacing an existing split of that name only on success). Samples go in
    image-id order, so shard 0 holds the first images of `CocoLikeDataset`'s
    order. A shard is closed before the next sample would take its file past
    `shard_bytes` (tar headers, end blocks and record padding counted), so a
    shard file exceeds it only when it holds one sample that alone does. Sample key: the image's `file_name` without its
    extension (it must be a plain name without dots: no directories).

    The index: {"format", "version", "split", "num_samples", "shards": [{"name",
    "num_samples", "bytes"}, ...], "categories"}.
    """
    _check_name(split, "split", allow_dots=True)
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    root = os.fspath(root)
    out_dir = os.fspath(out_dir)
    coco, plan = _load_split(ann_file)
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(out_dir, split)
    staging = tempfile.mkdtemp(prefix=f".{split}.tmp-", dir=out_dir)
    tar = None
    try:
        shards = []
        name = None
        written = count = 0

        def close_shard():
            tar.close()
            path = os.path.join(staging, name)
            _fsync_path(path)
            shards.append({"name": name, "num_samples": count, "bytes": os.path.getsize(path)})

        for key, ext, im, anns in plan:
            with open(os.path.join(root, im["file_name"]), "rb") as f:
                image_bytes = f.read()
            meta = json.dumps({"image_id": im["id"], "file_name": im["file_name"],
                               "width": im.get("width"), "height": im.get("height"),
                               "annotations": anns},
                              sort_keys=True, separators=(",", ":")).encode()
            size = _member_bytes(len(image_bytes)) + _member_bytes(len(meta))
            if tar is not None and _shard_file_bytes(written + size) > shard_bytes:
                close_shard()
                tar = None
            if tar is None:
                name = f"{split}-{len(shards):06d}.tar"
                tar = tarfile.open(os.path.join(staging, name), "w", format=tarfile.PAX_FORMAT)
                written = count = 0
            _add_member(tar, f"{key}.{ext}", image_bytes)
            _add_member(tar, f"{key}.json", meta)
            written += size
            count += 1
        if tar is not None:
            close_shard()
            tar = None
        index = {"format": FORMAT, "version": VERSION, "split": split,
                 "num_samples": sum(s["num_samples"] for s in shards), "shards": shards,
                 "categories": coco.get("categories", [])}
        index_path = os.path.join(staging, INDEX_NAME)
        with open(index_path, "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staging, 0o755)  # mkdtemp made it 0o700
        _publish(staging, final)
    except BaseException:
        if tar is not None:
            try:
                tar.close()
            except Exception:
                pass
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return index


def _publish(staging: str, final: str) -> None:
    """Rename `staging` to `final`; an existing `final` is moved aside first and
    restored if the rename fails, then deleted."""
    if not os.path.lexists(final):
        os.rename(staging, final)
    else:
        parent, base = os.path.split(final)
        old = os.path.join(parent, f".{base}.old-{uuid.uuid4().hex[:12]}")
        os.rename(final, old)
        try:
            os.rename(staging, final)
        except BaseException:
            os.rename(old, final)
            raise
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.unlink(old)
    try:
        _fsync_path(os.path.dirname(final) or ".")
    except OSError:
        pass


# ---------------------------------------------------------------------------
# reading

def read_index(out_dir, split: str = "train") -> dict:
    """The index `write_shards` wrote for `split` (checked: its shard names stay inside)."""
    _check_name(split, "split", allow_dots=True)
    with open(os.path.join(os.fspath(out_dir), split, INDEX_NAME)) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{out_dir}/{split}/{INDEX_NAME} is not a {FORMAT} index")
    for shard in index["shards"]:
        _check_name(shard["name"], "shard name in the index", allow_dots=True)
    return index


def shard_urls(out_dir, split: str = "train") -> list[str]:
    """Paths of `split`'s shards in order, for `webdataset.WebDataset(urls, ...)`."""
    index = read_index(out_dir, split)
    base = os.path.join(os.path.abspath(os.fspath(out_dir)), split)
    return [os.path.join(base, shard["name"]) for shard in index["shards"]]


def read_samples(url):
    """The samples of one shard, as WebDataset yields them before `.decode()`:
    dicts {"__key__", "__url__", "<ext>": bytes, ...}, members grouped by key
    (the name up to its first dot), in file order. Standard library only."""
    path = os.fspath(url)
    with tarfile.open(path, "r:") as tar:
        sample = None
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            if sample is None or sample["__key__"] != key:
                if sample is not None:
                    yield sample
                sample = {"__key__": key, "__url__": path}
            sample[ext] = tar.extractfile(member).read()
        if sample is not None:
            yield sample


def _image_of(sample):
    from PIL import Image

    for ext in ("jpg", "jpeg", "png"):
        if ext in sample:
            value = sample[ext]
            break
    else:
        raise KeyError(f"sample {sample.get('__key__')!r} has no image (keys: {sorted(sample)})")
    if isinstance(value, (bytes, bytearray, memoryview)):
        with Image.open(io.BytesIO(value)) as f:
            return f.convert("RGB")
    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None and isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3:
        return Image.fromarray(value, "RGB")
    raise TypeError(f"sample {sample.get('__key__')!r}: cannot use a {type(value).__name__} as the "
                    "image; pass the raw bytes or decode with .decode('pil') / .decode('rgb8')")


def decode_sample(sample, *, resolution: int = 576, masks: bool = False, multiscale=None,
                  augment: bool = True, keypoints: bool = False):
    """A WebDataset sample of `write_shards` -> `(image, target)` as `CocoLikeDataset` gives.

    `sample`: the dict WebDataset yields: raw (the image as bytes, "json" as
    bytes) or decoded (`.decode("pil")` or `.decode("rgb8")`: a PIL image or a
    uint8 HWC array, "json" a dict). Options and the use of Python's `random`
    are CocoLikeDataset's.
    """
    meta = sample["json"]
    if isinstance(meta, (bytes, bytearray, memoryview)):
        meta = json.loads(bytes(meta))
    elif isinstance(meta, str):
        meta = json.loads(meta)
    img = _image_of(sample)
    anns = [annotation_record(ann) for ann in meta["annotations"]]
    return build_sample(img, int(meta["image_id"]), anns, resolution=resolution, masks=masks,
                        multiscale=multiscale, augment=augment, keypoints=keypoints)


class DecodeSample:
    """`decode_sample` with its options bound, picklable: `pipeline.map(DecodeSample(...))`."""

    def __init__(self, resolution: int = 576, masks: bool = False, multiscale=None,
                 augment: bool = True, keypoints: bool = False):
        self.resolution = int(resolution)
        self.masks = masks
        self.multiscale = tuple(int(s) for s in multiscale) if multiscale else None
        self.augment = augment
        self.keypoints = keypoints

    def __call__(self, sample):
        return decode_sample(sample, resolution=self.resolution, masks=self.masks,
                             multiscale=self.multiscale, augment=self.augment,
                             keypoints=self.keypoints)

    def __repr__(self) -> str:
        return (f"DecodeSample(resolution={self.resolution}, masks={self.masks}, "
                f"multiscale={self.multiscale}, augment={self.augment}, "
                f"keypoints={self.keypoints})")
