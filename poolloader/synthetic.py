"""Synthetic COCO-like detection data for tests, benchmarks and example training.

* `make_coco_like` writes real JPEG files (smooth gradients, blurred noise,
  grain and textured polygon objects: entropy like a photograph, not flat
  colours) and a COCO-format annotation file, deterministically from a seed.
* `CocoLikeDataset` reads them the way RF-DETR's COCO pipeline does: Pillow
  decode, random horizontal flip, square resize, ImageNet normalisation, and a
  target dict with RF-DETR's fields and dtypes (optionally masks and keypoints).
* `build_sample` is that per-image transform on its own (decoded image +
  annotation records -> `(image, target)`), shared with the tar-shard reader
  (`poolloader.shards.decode_sample`) so both give the same tensors.
* `FilledDetectionDataset` returns the same structure from cheap deterministic
  tensors, for measuring the worker-to-main hand-off without decode cost.

Everything here is picklable (spawn / forkserver workers) and uses only
Python's `random` for augmentation, so DataLoader's per-worker seeding decides
the augmentation exactly as it would for RF-DETR.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

# Non-contiguous ids, as in COCO.
CATEGORIES = [(1, "disc"), (2, "star"), (3, "shard"), (5, "leaf"), (8, "stone"), (13, "kite")]
KEYPOINTS = 5  # per instance: the first five polygon vertices
EMPTY_FRACTION = 0.1  # images without any annotation
MEAN_INSTANCES = 7.0  # over all images, the empty ones included
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# ---------------------------------------------------------------------------
# writing the data set

def _polygon(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A star-shaped polygon (k >= KEYPOINTS vertices) inside the image, as [k, 2] floats."""
    k = int(rng.integers(KEYPOINTS, 13))
    radius = rng.uniform(0.04, 0.22) * min(width, height)
    cx = rng.uniform(radius * 0.5, width - radius * 0.5)
    cy = rng.uniform(radius * 0.5, height - radius * 0.5)
    angles = np.sort(rng.uniform(0.0, 2.0 * math.pi, k))
    radii = radius * rng.uniform(0.45, 1.0, k)
    pts = np.stack([cx + radii * np.cos(angles), cy + radii * np.sin(angles)], axis=1)
    pts[:, 0] = np.clip(pts[:, 0], 0.0, width)
    pts[:, 1] = np.clip(pts[:, 1], 0.0, height)
    return np.round(pts, 2)


def _shoelace(pts: np.ndarray) -> float:
    x, y = pts[:, 0], pts[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2.0)


def _upsampled(rng: np.random.Generator, cells: tuple[int, int], size: tuple[int, int],
               spread: float) -> np.ndarray:
    """Smooth random field: a coarse random RGB grid resized bicubically to `size` (w, h)."""
    coarse = rng.normal(128.0, spread, (cells[1], cells[0], 3)).clip(0, 255).astype(np.uint8)
    return np.asarray(Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC),
                      dtype=np.float32) - 128.0


def _render(rng: np.random.Generator, width: int, height: int, polygons) -> Image.Image:
    size = (width, height)
    canvas = _upsampled(rng, (4, 3), size, 60.0) + 128.0            # lighting / gradients
    canvas += _upsampled(rng, (width // 16 + 1, height // 16 + 1), size, 30.0)  # blotches
    if polygons:
        ids = Image.new("L", size, 0)
        draw = ImageDraw.Draw(ids)
        for j, pts in enumerate(polygons):
            draw.polygon([tuple(p) for p in pts], fill=j + 1)
        ids = np.asarray(ids)
        colours = np.zeros((len(polygons) + 1, 3), np.float32)
        colours[1:] = rng.uniform(20, 235, (len(polygons), 3))
        shade = np.linspace(0.75, 1.15, width, dtype=np.float32)[None, :, None]
        inside = ids[..., None] > 0
        texture = _upsampled(rng, (width // 8 + 1, height // 8 + 1), size, 25.0)
        canvas = np.where(inside, colours[ids] * shade + texture, canvas)
    canvas += rng.standard_normal((height, width, 3), dtype=np.float32) * 5.0   # sensor grain
    return Image.fromarray(canvas.clip(0, 255).astype(np.uint8), "RGB")


def make_coco_like(root, num_images: int, seed: int, size=(640, 480), quality: int = 90) -> str:
    """Write `num_images` JPEGs and `annotations.json` (COCO format) under `root`.

    `size` is (width, height). About MEAN_INSTANCES objects per image on
    average, EMPTY_FRACTION of the images without any. Each annotation has
    bbox [x, y, w, h], one polygon, its area, iscrowd 0, category_id and
    KEYPOINTS keypoints (x, y, v=2). Same seed, same files byte for byte (for
    one Pillow version). Returns the annotation file's path. Cost: ~25 ms per
    640×480 image on one core.
    """
    os.makedirs(root, exist_ok=True)
    width, height = int(size[0]), int(size[1])
    lam = MEAN_INSTANCES / (1.0 - EMPTY_FRACTION)
    images, annotations = [], []
    for i in range(num_images):
        rng = np.random.default_rng([seed, i])
        image_id = i + 1
        n = 0 if rng.random() < EMPTY_FRACTION else max(1, int(rng.poisson(lam)))
        polygons = [_polygon(rng, width, height) for _ in range(n)]
        labels = [CATEGORIES[int(c)][0] for c in rng.integers(0, len(CATEGORIES), n)]
        file_name = f"{image_id:012d}.jpg"
        _render(rng, width, height, polygons).save(
            os.path.join(root, file_name), "JPEG", quality=quality)
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        for pts, label in zip(polygons, labels):
            x0, y0 = pts.min(axis=0)
            x1, y1 = pts.max(axis=0)
            kps = [[float(x), float(y), 2] for x, y in pts[:KEYPOINTS]]
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": label,
                "bbox": [round(float(x0), 2), round(float(y0), 2),
                         round(float(x1 - x0), 2), round(float(y1 - y0), 2)],
                "segmentation": [[float(v) for v in pts.reshape(-1)]],
                "area": round(_shoelace(pts), 2), "iscrowd": 0,
                "keypoints": [v for kp in kps for v in kp], "num_keypoints": KEYPOINTS,
            })
    coco = {
        "info": {"description": f"poolloader synthetic COCO-like data, seed {seed}"},
        "images": images, "annotations": annotations,
        "categories": [{"id": cid, "name": name, "supercategory": "shape",
                        "keypoints": [f"v{k}" for k in range(KEYPOINTS)], "skeleton": []}
                       for cid, name in CATEGORIES],
    }
    path = os.path.join(root, "annotations.json")
    with open(path, "w") as f:
        json.dump(coco, f)
    return path


# ---------------------------------------------------------------------------
# reading it

def cached_coco_like(images: int, seed: int, root: str | None = None) -> tuple[str, str]:
    """(root, annotation file) of a `make_coco_like` data set, generated on first use.

    `root` defaults to <tmp>/poolloader-data/coco-like-seed<S>-n<N>. The data is
    written into a private temporary folder and renamed into place, so a
    half-written cache is never used and concurrent runs do not collide.
    """
    root = root or os.path.join(tempfile.gettempdir(), "poolloader-data",
                                f"coco-like-seed{seed}-n{images}")
    ann = os.path.join(root, "annotations.json")
    if os.path.exists(ann):
        return root, ann
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".coco-like-", dir=parent)
    try:
        make_coco_like(tmp, images, seed)
        try:
            os.rename(tmp, root)
        except OSError:
            if not os.path.exists(ann):  # not another run winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root, ann


def _to_normalised_tensor(img: Image.Image) -> torch.Tensor:
    arr = np.asarray(img, dtype=np.float32) / 255.0
    arr = (arr - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


class CocoLikeDataset(Dataset):
    """Map-style COCO reader returning `(image float32 [3,S,S], target)` like RF-DETR.

    Per item: Pillow decode; with `augment`, a horizontal flip with probability
    0.5 (`random.random()`); a square resize to `resolution`, or to
    `random.choice(multiscale)` when `multiscale` is given; ImageNet
    normalisation. Python's `random` is the only RNG used, so the item is a
    function of the index and that RNG's state (DataLoader seeds it per worker).

    target: boxes float32 [N,4] (cx, cy, w, h normalised to [0, 1]), labels
    int64 [N] (category ids), image_id int64 [1], area float32 [N] (scaled to
    the resized image), iscrowd int64 [N], orig_size int64 [2] and size int64
    [2] (h, w); with `masks`, masks bool [N,S,S] rasterised from the polygons
    at the output size; with `keypoints`, keypoints float32 [N,K,3] (x, y
    normalised, visibility; a flip mirrors x but does not swap left/right names).
    Boxes with no width or height are dropped with their masks and keypoints.
    Segmentations must be polygons (no RLE), as make_coco_like writes them.
    """

    def __init__(self, root, ann_file, resolution: int = 576, masks: bool = False,
                 multiscale=None, augment: bool = True, keypoints: bool = False):
        self.root = os.fspath(root)
        self.resolution = int(resolution)
        self.masks = masks
        self.multiscale = tuple(int(s) for s in multiscale) if multiscale else None
        self.augment = augment
        self.keypoints = keypoints
        with open(ann_file) as f:
            coco = json.load(f)
        self.images = sorted((im["id"], im["file_name"]) for im in coco["images"])
        self.annotations = {image_id: [] for image_id, _ in self.images}
        for ann in coco["annotations"]:
            self.annotations[ann["image_id"]].append(annotation_record(ann))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image_id, file_name = self.images[index]
        with Image.open(os.path.join(self.root, file_name)) as f:
            img = f.convert("RGB")
        return build_sample(img, image_id, self.annotations[image_id],
                            resolution=self.resolution, masks=self.masks,
                            multiscale=self.multiscale, augment=self.augment,
                            keypoints=self.keypoints)


def annotation_record(ann: dict) -> tuple:
    """One COCO annotation dict as the tuple `build_sample` reads:
    (bbox, category_id, area, iscrowd, segmentation, keypoints)."""
    return (ann["bbox"], ann["category_id"], ann["area"], ann.get("iscrowd", 0),
            ann.get("segmentation", []), ann.get("keypoints", []))


def build_sample(img: Image.Image, image_id: int, anns, *, resolution: int = 576,
                 masks: bool = False, multiscale=None, augment: bool = True,
                 keypoints: bool = False):
    """`(image, target)` exactly as `CocoLikeDataset.__getitem__` builds it.

    `img`: the decoded RGB image at its original size; `anns`: that image's
    annotations as `annotation_record` tuples. Draws from Python's `random`
    in the same order as the dataset (flip, then the multiscale side), so any
    reader of the same bytes and annotations (tar shards, see
    `poolloader.shards.decode_sample`) gives the same tensors bit for bit for
    the same RNG state.
    """
    multiscale = tuple(int(s) for s in multiscale) if multiscale else None
    width, height = img.size
    flip = augment and random.random() < 0.5
    side = random.choice(multiscale) if multiscale else int(resolution)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    img = img.resize((side, side), Image.Resampling.BILINEAR)

    anns = [a for a in anns if a[0][2] > 0 and a[0][3] > 0]
    n = len(anns)
    xyxy = np.zeros((n, 4), np.float64)
    for j, (bbox, *_rest) in enumerate(anns):
        x, y, w, h = bbox
        xyxy[j] = (max(0.0, x), max(0.0, y), min(width, x + w), min(height, y + h))
    if flip:
        xyxy[:, [0, 2]] = width - xyxy[:, [2, 0]]
    scale = np.asarray([width, height, width, height], np.float64)
    cxcywh = np.stack([(xyxy[:, 0] + xyxy[:, 2]) / 2, (xyxy[:, 1] + xyxy[:, 3]) / 2,
                       xyxy[:, 2] - xyxy[:, 0], xyxy[:, 3] - xyxy[:, 1]], axis=1) / scale
    ratio = (side / width) * (side / height)
    target = {
        "boxes": torch.from_numpy(cxcywh.astype(np.float32).reshape(n, 4)),
        "labels": torch.tensor([a[1] for a in anns], dtype=torch.int64),
        "image_id": torch.tensor([image_id], dtype=torch.int64),
        "area": torch.tensor([a[2] * ratio for a in anns], dtype=torch.float32),
        "iscrowd": torch.tensor([a[3] for a in anns], dtype=torch.int64),
        "orig_size": torch.tensor([height, width], dtype=torch.int64),
        "size": torch.tensor([side, side], dtype=torch.int64),
    }
    if masks:
        target["masks"] = _rasterise(anns, width, height, side, flip)
    if keypoints:
        kps = np.zeros((n, KEYPOINTS, 3), np.float32)
        for j, ann in enumerate(anns):
            if ann[5]:
                kps[j] = np.asarray(ann[5], np.float32).reshape(KEYPOINTS, 3)
        if flip:
            kps[:, :, 0] = np.where(kps[:, :, 2] > 0, width - kps[:, :, 0], 0.0)
        kps[:, :, 0] /= width
        kps[:, :, 1] /= height
        target["keypoints"] = torch.from_numpy(kps)
    return _to_normalised_tensor(img), target


def _rasterise(anns, width, height, side, flip) -> torch.Tensor:
    masks = np.zeros((len(anns), side, side), bool)
    sx, sy = side / width, side / height
    for j, ann in enumerate(anns):
        canvas = Image.new("L", (side, side), 0)
        draw = ImageDraw.Draw(canvas)
        for poly in ann[4]:
            pts = np.asarray(poly, np.float64).reshape(-1, 2)
            if flip:
                pts[:, 0] = width - pts[:, 0]
            draw.polygon([(x * sx, y * sy) for x, y in pts], fill=1)
        masks[j] = np.asarray(canvas, dtype=bool)
    return torch.from_numpy(masks)


class FilledDetectionDataset(Dataset):
    """`(image, target)` like CocoLikeDataset from cheap deterministic tensors (no JPEG).

    Item `i` depends only on (seed, i): its instance count is uniform in
    [0, 2 × instances] (mean `instances`, some images empty), its size is
    `resolution` square, or one of `sizes` (ints for squares, (h, w) pairs)
    chosen per item. The image is a broadcast ramp (about one write per
    element). With `masks`, box-shaped bool masks [N,H,W]; with `keypoints`,
    keypoints float32 [N,5,3]. For hand-off benchmarks and loader tests.
    """

    def __init__(self, n: int, resolution: int = 576, instances: int = 7, seed: int = 0,
                 sizes=None, masks: bool = False, keypoints: bool = False):
        self.n = int(n)
        self.resolution = int(resolution)
        self.instances = int(instances)
        self.seed = int(seed)
        self.sizes = [(s, s) if isinstance(s, int) else (int(s[0]), int(s[1]))
                      for s in sizes] if sizes else None
        self.masks = masks
        self.keypoints = keypoints

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        rng = random.Random(self.seed * 1_000_003 + index)
        h, w = rng.choice(self.sizes) if self.sizes else (self.resolution, self.resolution)
        n = rng.randint(0, 2 * self.instances)
        level = torch.tensor([rng.random(), rng.random(), rng.random()]).view(3, 1, 1)
        image = (level + torch.linspace(-1.0, 1.0, w).view(1, 1, w)
                 + torch.linspace(0.0, 0.5, h).view(1, h, 1))
        xyxy = []
        for _ in range(n):
            x0, y0 = rng.uniform(0, 0.8), rng.uniform(0, 0.8)
            xyxy.append((x0, y0, x0 + rng.uniform(0.02, 0.2), y0 + rng.uniform(0.02, 0.2)))
        b = torch.tensor(xyxy, dtype=torch.float32).view(n, 4)
        boxes = torch.stack([(b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2,
                             b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], dim=1)
        target = {
            "boxes": boxes,
            "labels": torch.tensor([rng.randrange(1, 91) for _ in range(n)], dtype=torch.int64),
            "image_id": torch.tensor([index], dtype=torch.int64),
            "area": boxes[:, 2] * boxes[:, 3] * float(h * w),
            "iscrowd": torch.zeros(n, dtype=torch.int64),
            "orig_size": torch.tensor([h, w], dtype=torch.int64),
            "size": torch.tensor([h, w], dtype=torch.int64),
        }
        if self.masks:
            masks = torch.zeros((n, h, w), dtype=torch.bool)
            for j, (x0, y0, x1, y1) in enumerate(xyxy):
                rows = slice(int(y0 * h), int(math.ceil(y1 * h)))
                masks[j, rows, int(x0 * w):int(math.ceil(x1 * w))] = True
            target["masks"] = masks
        if self.keypoints:
            kps = torch.empty((n, 5, 3), dtype=torch.float32)
            step = 0.01 * torch.arange(5, dtype=torch.float32).view(1, 5, 1)
            kps[:, :, :2] = boxes[:, None, :2] + step
            kps[:, :, 2] = 2.0
            target["keypoints"] = kps
        return image, target
