"""Where the time from bytes to tensor goes: ``python -m bench.preprocess_bench [--models resnet50,open_clip:ViT-B-32]
[--reps 3]``.

One thread, no server, each photo timed alone (the best of ``--reps``), on the album's phone photos (1-5 MB, up to
12 MP) and on immich's 1440-px previews. Per model (its own transform; an immich-named CLIP uses the exact one):

    served        ``prepare.decode_and_crop``, what a decode thread runs
    open          the header checks (format, pixel limit) before any pixel
    decode        libjpeg at the draft scale the transform allows (1/8 of a 12 MP photo for a 224-px model)
    upright, rgb  EXIF orientation and mode conversion
    resize+crop   the one resample call (or the exact transform's two steps), to uint8 HWC
    no draft      decoding every pixel instead, then the same resize: what the draft scale saves
    torchvision   ``torchvision.io.decode_jpeg`` (libjpeg-turbo too, no draft scale) then the same resize: whether
                  another decoder at hand is cheaper

Normalisation is not here: it runs batched in the model's first op (OpenVINO) or on the model's device. Parity: the
served crops against the family's reference (every pixel decoded, EXIF applied, torchvision's ``Resize`` and
``CenterCrop`` on the PIL image, or the exact transform's own steps): the lowest cosine between the model's float32
outputs for the two (seeded random weights), and the mean |difference| of the crops in grey levels. Writes
bench/out/preprocess.json.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from bench import bare
from bench.album import DEFAULT_DIR, ensure_album, load_album
from bench.compare import OUT_DIR
from bench.immich_bench import previews
from bench.report import rows_table, start, write_json
from service.engine.model import LoadedModel
from service.engine.types import Transform
from service.pipeline.decode import configure_pillow, open_checked, to_rgb
from service.pipeline.prepare import decode_and_crop, draft_size
from service.pipeline.preprocess import _RESAMPLE, exact, preprocess

MAX_PIXELS = 40_000_000
MODELS = ("resnet50", "open_clip:ViT-B-32", "open_clip:ViT-B-32__openai")


def best_ms(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def reference(data: bytes, t: Transform) -> np.ndarray:
    """The family's own preprocessing of every decoded pixel: torchvision's PIL transforms, or the exact ones."""
    from torchvision.transforms import CenterCrop, InterpolationMode, Resize

    img = to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    if t.exact:
        return exact(img, t)
    if t.resize_mode == "squash":
        return np.asarray(img.resize((t.crop_size, t.crop_size), _RESAMPLE[t.interpolation]))
    resized = Resize(t.resize_size, InterpolationMode(t.interpolation), antialias=True)(img)
    return np.asarray(CenterCrop(t.crop_size)(resized))


def agreement(model: LoadedModel, served: list[np.ndarray], ref: list[np.ndarray]) -> tuple[float, float]:
    """(the lowest cosine between the model's outputs for the served and the reference crops, their mean
    |difference| in grey levels)."""
    def outputs(crops: list[np.ndarray]) -> np.ndarray:
        feats, _ = model.forward(np.stack(crops))
        assert feats is not None
        f = feats.float().numpy()
        return f / np.linalg.norm(f, axis=1, keepdims=True)

    cosine = float((outputs(served) * outputs(ref)).sum(1).min())
    return cosine, float(np.mean([np.abs(a.astype(np.float64) - b).mean() for a, b in zip(served, ref, strict=True)]))


def stages(data: bytes, t: Transform, reps: int) -> dict[str, float]:
    """Milliseconds of each step of the served path and of the alternatives, for one photo."""
    from torchvision.io import decode_jpeg

    def decoded() -> Image.Image:  # decode_opened's steps up to the pixels, as a decode thread takes them
        img = open_checked(data, MAX_PIXELS)
        img.draft("RGB", (draft_size(t), draft_size(t)))
        img.decodermaxblock = max(img.decodermaxblock, len(data))  # type: ignore[attr-defined]  # an ImageFile's
        img.load()
        return img

    img = decoded()
    upright = to_rgb(ImageOps.exif_transpose(img) or img)
    resample = exact if t.exact else preprocess
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    opening = best_ms(lambda: open_checked(data, MAX_PIXELS), reps)
    return {"served": best_ms(lambda: decode_and_crop(data, t, MAX_PIXELS), reps), "open": opening,
            "decode": best_ms(decoded, reps) - opening,
            "upright, rgb": best_ms(lambda: to_rgb(ImageOps.exif_transpose(img) or img), reps),
            "resize+crop": best_ms(lambda: resample(upright, t), reps),
            "no draft": best_ms(lambda: resample(to_rgb(Image.open(io.BytesIO(data))), t), reps),
            "torchvision": best_ms(lambda: resample(Image.fromarray(decode_jpeg(raw).permute(1, 2, 0).numpy()), t),
                                   reps)}


def one(model: str, photos: dict[str, bytes], reps: int) -> dict[str, Any]:
    from service.engine.loading import load_model

    arch = model.partition("__")[0]
    weights = bare.save_random_weights(arch, OUT_DIR / "weights" / f"{bare.slug(arch)}-seed0.pt")
    loaded = load_model(model, str(weights))
    t = loaded.info.transform
    rows = [stages(data, t, reps) for data in photos.values()]
    cosine, grey = agreement(loaded, [decode_and_crop(d, t, MAX_PIXELS) for d in photos.values()],
                             [reference(d, t) for d in photos.values()])
    out = {k: round(statistics.mean(r[k] for r in rows), 2) for k in rows[0]}
    return {**out, "min_cosine": round(cosine, 6), "mean_abs_grey": round(grey, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    info = start("bench.preprocess_bench", args.models, argv)
    configure_pillow(MAX_PIXELS)
    torch.set_num_threads(1)
    inputs = {"album (phone photos)": load_album(ensure_album(DEFAULT_DIR)), "immich previews (1440 px)": previews(12)}
    table = []
    for name, photos in inputs.items():
        megabytes = statistics.mean(map(len, photos.values())) / 1e6
        for model in args.models.split(","):
            r = one(model, photos, args.reps)
            table.append({"photos": f"{name}, {megabytes:.1f} MB", "model": model, "served ms": r["served"],
                          "open": r["open"], "decode (draft)": r["decode"], "upright, rgb": r["upright, rgb"],
                          "resize+crop": r["resize+crop"], "decode share": f"{r['decode'] / r['served']:.0%}",
                          "no draft ms": r["no draft"], "torchvision decode ms": r["torchvision"],
                          "min cosine to reference": r["min_cosine"], "mean abs grey": r["mean_abs_grey"]})
            print(table[-1], flush=True)
    print(rows_table(table))
    write_json(OUT_DIR / "preprocess.json", {"machine": info, "rows": table})


if __name__ == "__main__":
    main()
