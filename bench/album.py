"""The comparison's album: 30 deterministic, photo-like JPEGs at phone sizes (up to 12 MP, some EXIF-rotated).

Generated, never downloaded: smooth colour fields (sky, walls, skin-like gradients) plus fine grain, so
libjpeg sees what it sees in phone photos and the files weigh what phone files weigh (1–5 MB). Files
are cached under ``bench/out/`` (gitignored) keyed by ``ALBUM_VERSION`` and the spec, so a second run
costs nothing. ``python -m bench.album`` prints the album's directory and sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

ALBUM_VERSION = 1  # bump when the generator changes: cached files of another version are not reused
DEFAULT_DIR = Path(__file__).resolve().parent / "out" / "album"
JPEG_QUALITY = 90  # what phone cameras write (88–95)
GRAIN_TILE = 509  # grain is a tiled noise patch: fast, and a prime side keeps it off the 8x8 JPEG grid
GRAIN_SIGMA = 11.0  # grey levels; sets the file size (a 12 MP file lands at ~4 MB, like a phone's)

# (width, height) as stored in the file; the first four sizes are 12 MP.
PHONE_SIZES = ((4032, 3024), (3024, 4032), (4000, 3000), (1920, 1080), (3264, 2448), (1080, 1920),
               (2592, 1944), (4032, 2268), (2048, 1536), (3000, 4000))
# EXIF Orientation for some images: 6 / 8 = shot in portrait (stored landscape), 3 = upside down.
ORIENTATIONS = {2: 6, 5: 8, 8: 3, 12: 6, 17: 8, 23: 3, 26: 6}


@dataclass(frozen=True)
class Photo:
    name: str
    width: int
    height: int
    orientation: int  # EXIF Orientation tag; 1 = as stored
    seed: int


def album_spec(count: int = 30, *, max_side: int | None = None) -> list[Photo]:
    """The album's photos, in order. ``max_side`` scales every size down (tests use tiny albums)."""
    photos = []
    for i in range(count):
        w, h = PHONE_SIZES[i % len(PHONE_SIZES)]
        if max_side and max(w, h) > max_side:
            f = max_side / max(w, h)
            w, h = max(16, int(w * f)), max(16, int(h * f))
        photos.append(Photo(f"img{i + 1:03d}.jpg", w, h, ORIENTATIONS.get(i, 1), seed=1000 + i))
    return photos


def render(p: Photo) -> bytes:
    """One photo as JPEG bytes: a pure function of ``p`` (same bytes on every run with the same Pillow)."""
    rng = np.random.default_rng(p.seed)
    # three scales of smooth colour: the big shapes of a scene, mid-size objects, fine texture
    scene = _upsampled(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8), p.width, p.height)
    objects = _upsampled(rng.integers(0, 256, (max(2, p.height // 96), max(2, p.width // 96), 3),
                                      dtype=np.uint8), p.width, p.height)
    base = 0.65 * scene.astype(np.float32) + 0.35 * objects.astype(np.float32)
    tile = rng.normal(0.0, GRAIN_SIGMA, (GRAIN_TILE, GRAIN_TILE, 1)).astype(np.float32)
    reps = (-(-p.height // GRAIN_TILE), -(-p.width // GRAIN_TILE), 1)
    grain = np.tile(tile, reps)[: p.height, : p.width]
    pixels = np.clip(base + grain, 0, 255).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0110] = "greenserve album"  # Model
    if p.orientation != 1:
        exif[0x0112] = p.orientation
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "JPEG", quality=JPEG_QUALITY, exif=exif)
    return buf.getvalue()


def _upsampled(small: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(small, "RGB").resize((width, height), Image.Resampling.BICUBIC))


def ensure_album(directory: Path = DEFAULT_DIR, *, count: int = 30, max_side: int | None = None) -> Path:
    """Generate the album into ``directory`` unless an identical one is already there; return its path.

    The directory holds the JPEGs and ``manifest.json`` (spec + version); a different spec or version
    regenerates everything, so stale files are never served.
    """
    spec = album_spec(count, max_side=max_side)
    manifest = {"version": ALBUM_VERSION, "photos": [asdict(p) for p in spec]}
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    manifest_path = directory / "manifest.json"
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if old.get("key") == key and all((directory / p.name).is_file() for p in spec):
            return directory
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.jpg"):
        stale.unlink()
    for p in spec:
        (directory / p.name).write_bytes(render(p))
    manifest_path.write_text(json.dumps({**manifest, "key": key}, indent=1))
    return directory


def load_album(directory: Path) -> dict[str, bytes]:
    """name → bytes of every photo listed in the album's manifest, in album order."""
    manifest = json.loads((directory / "manifest.json").read_text())
    return {p["name"]: (directory / p["name"]).read_bytes() for p in manifest["photos"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--count", type=int, default=30)
    args = parser.parse_args()
    blobs = load_album(ensure_album(args.dir, count=args.count))
    for name, data in blobs.items():
        with Image.open(io.BytesIO(data)) as img:
            orientation = img.getexif().get(0x0112, 1)
            print(f"{name}  {img.width}x{img.height}  orientation={orientation}  {len(data) / 1e6:.2f} MB")
    print(f"{len(blobs)} photos, {sum(map(len, blobs.values())) / 1e6:.1f} MB in {args.dir}")


if __name__ == "__main__":
    main()
