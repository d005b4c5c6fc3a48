"""JPEGs decoded on the model's device (GREENSERVE_JPEG_DECODE=device). The same code runs on CUDA (nvJPEG)
and on the CPU (libjpeg-turbo through torchvision), so here it runs on the CPU: the header checks in the
decode thread, the batch decode with per-file failures, EXIF orientation, resize + crop against the Pillow
path, and a real model's mixed batch."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from harness import images
from service.engine.loading import load_model
from service.engine.types import EncodedJpeg, Transform
from service.errors import ImageTooLarge, NotAnImage, UnsupportedImage
from service.pipeline import device_decode
from service.pipeline.decode import configure_pillow, jpeg_for_device, open_checked
from service.pipeline.prepare import checked_for_device, decode_and_crop

pytestmark = pytest.mark.slow  # real models: not in make test-fast

CPU = torch.device("cpu")
T = Transform(resize_size=256, crop_size=224)
MAX_PIXELS = 40_000_000


@pytest.fixture(autouse=True)
def _pillow() -> None:
    configure_pillow(MAX_PIXELS)


def encoded(data: bytes) -> EncodedJpeg:
    jpeg = jpeg_for_device(open_checked(data, MAX_PIXELS), data)
    assert jpeg is not None
    return jpeg


def test_a_complete_rgb_or_grey_jpeg_goes_to_the_device_with_its_orientation() -> None:
    assert encoded(images.jpeg(64, 48)).orientation == 1
    assert encoded(images.jpeg_with_orientation(6)).orientation == 6
    grey = images.encode(images.photo(64, 48).convert("L"), "JPEG")
    assert np.array_equal(encoded(grey).data, np.frombuffer(grey, np.uint8))


@pytest.mark.parametrize("data", [images.encode(images.photo(32, 32), "PNG"),
                                  images.encode(images.photo(32, 32).convert("CMYK"), "JPEG"),
                                  images.truncated_jpeg()], ids=["png", "cmyk", "truncated"])
def test_everything_else_stays_with_pillow(data: bytes) -> None:
    assert jpeg_for_device(open_checked(data, MAX_PIXELS), data) is None


def test_the_safety_checks_run_before_anything_is_decoded() -> None:
    with pytest.raises(ImageTooLarge):
        checked_for_device(images.jpeg(400, 300), T, 100_000)
    with pytest.raises(UnsupportedImage):
        checked_for_device(images.tiff(), T, MAX_PIXELS)
    with pytest.raises(NotAnImage) as caught:  # Pillow names it, as it does without device decoding
        checked_for_device(images.truncated_jpeg(), T, MAX_PIXELS)
    assert caught.value.code == "truncated_image"
    with pytest.raises(NotAnImage) as empty:
        checked_for_device(b"", T, MAX_PIXELS)
    assert empty.value.code == "empty_image"


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_matches_pillows_exif_transpose(orientation: int) -> None:
    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)  # no symmetry
    exif = Image.Exif()
    exif[0x0112] = orientation
    img = Image.open(io.BytesIO(images.encode(Image.fromarray(pixels), "PNG", exif=exif)))
    expected = np.asarray(ImageOps.exif_transpose(img))
    ours = device_decode.upright(torch.from_numpy(pixels).permute(2, 0, 1), orientation).permute(1, 2, 0)
    assert np.array_equal(ours.numpy(), expected)


@pytest.mark.parametrize(("size", "transform"), [
    ((3024, 4032), T), ((4032, 3024), T), ((800, 600), Transform(232, 224)), ((150, 100), T),
    ((1200, 900), Transform(224, 224, interpolation="bicubic", resize_mode="squash"))])
def test_resize_and_crop_match_the_pillow_path(size: tuple[int, int], transform: Transform) -> None:
    data = images.jpeg(*size, seed=sum(size))
    crops, failed = device_decode.crops([encoded(data)], transform, CPU)
    assert not failed and crops[0] is not None
    ours = crops[0].permute(1, 2, 0).numpy().astype(np.float32)
    pillow = decode_and_crop(data, transform, MAX_PIXELS).astype(np.float32)
    assert ours.shape == pillow.shape
    assert np.abs(ours - pillow).mean() < 3.0  # the same picture within a few grey levels (JPEG draft
    # decoding, Pillow's reducing_gap and box rounding each move it a little)


def test_an_oriented_photo_comes_out_the_way_pillow_turns_it() -> None:
    data = images.jpeg_with_orientation(6, 320, 200)
    crops, _ = device_decode.crops([encoded(data)], Transform(64, 64), CPU)
    assert crops[0] is not None
    pillow = decode_and_crop(data, Transform(64, 64), MAX_PIXELS).astype(np.float32)
    assert np.abs(crops[0].permute(1, 2, 0).numpy() - pillow).mean() < 3.0


def test_one_file_the_decoder_refuses_fails_alone() -> None:
    good = encoded(images.jpeg(200, 150, seed=1))
    bad = EncodedJpeg(np.frombuffer(images.truncated_jpeg(), np.uint8).copy())  # past the header checks
    crops, failed = device_decode.crops([good, bad, good], T, CPU)
    assert set(failed) == {1} and isinstance(failed[1], device_decode.DeviceDecodeFailed)
    assert crops[1] is None and crops[0] is not None and torch.equal(crops[0], crops[2])  # type: ignore[arg-type]


def test_the_mode_follows_the_setting_the_device_and_the_filter() -> None:
    assert device_decode.usable("auto", CPU, T) == (False, "the model is on cpu (auto decodes on the device only on CUDA)")
    assert not device_decode.usable("pillow", CPU, T)[0]
    assert device_decode.usable("device", CPU, T)[0]  # and its probe JPEG decoded here
    assert not device_decode.usable("device", CPU, Transform(interpolation="lanczos"))[0]
    assert not device_decode.usable("device", CPU, Transform(exact=True))[0]  # Pillow's pixels, not nearly them


def test_a_real_models_mixed_batch_matches_the_pillow_path_row_by_row() -> None:
    torch.manual_seed(0)
    model = load_model("resnet18", "random")
    model.decoder = device_decode
    t = model.info.transform
    blobs = [images.jpeg(640 + 64 * i, 480, seed=i) for i in range(3)]
    png = images.encode(images.photo(300, 200, seed=9), "PNG")
    bad = EncodedJpeg(np.frombuffer(images.truncated_jpeg(), np.uint8).copy())
    items = [encoded(blobs[0]), decode_and_crop(png, t, MAX_PIXELS), bad, encoded(blobs[1]), encoded(blobs[2])]
    feats, logits, failed = model.forward_items(items)
    assert set(failed) == {2} and feats is not None and logits is not None
    assert torch.count_nonzero(feats[2]) == 0  # the failed item's row is a placeholder
    reference, _ = model.forward(np.stack([decode_and_crop(b, t, MAX_PIXELS) for b in (blobs[0], png, blobs[1], blobs[2])]))
    assert reference is not None
    cos = torch.nn.functional.cosine_similarity(feats[[0, 1, 3, 4]], reference)
    assert float(cos.min()) > 0.995, cos
    assert float(cos[1]) > 0.99999  # the Pillow crop in the mixed batch is the same crop


def test_over_http_a_jpeg_the_device_refuses_is_served_through_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from harness.fakes import FakeFetcher
    from service.app import create_app
    from service.settings import Settings

    base = "http://cdn.test/"
    blobs = {f"p{i}.jpg": images.jpeg(320 + 32 * i, 240, seed=i) for i in range(3)}
    refused = len(blobs["p1.jpg"])
    real = device_decode._decode

    def picky(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if any(len(t) == refused for t in tensors):  # as nvJPEG refuses an unusual file
            raise RuntimeError("nvjpeg: unsupported")
        return real(tensors, device)

    monkeypatch.setattr(device_decode, "_decode", picky)
    torch.manual_seed(0)
    model = load_model("resnet18", "random")
    model.info, model.decoder = dataclasses.replace(model.info, jpeg_decode="device"), device_decode
    settings = Settings(image_base_url=base, workers=1)
    fetcher = FakeFetcher({base + name: blob for name, blob in blobs.items()})
    client = create_app(settings, model=model, fetcher=fetcher).test_client()
    r = client.post("/v1/embeddings", json={"images": list(blobs), "normalize": False})
    assert r.status_code == 200, r.json
    got = torch.tensor([d["embedding"] for d in r.json["data"]])
    reference, _ = model.forward(np.stack([decode_and_crop(b, model.info.transform, MAX_PIXELS) for b in blobs.values()]))
    assert reference is not None
    cos = torch.nn.functional.cosine_similarity(got, reference)
    assert float(cos[1]) > 0.99999  # the refused one: Pillow's own crop
    assert float(cos.min()) > 0.995
    assert client.get("/v1/models").json["data"][0]["jpeg_decode"] == "device"
    bad = client.post("/v1/embeddings", json={"images": ["p0.jpg", "data:image/jpeg;base64,AAAA"]})
    assert bad.status_code == 422 and bad.json["error"]["code"] in ("not_an_image", "invalid_base64")
    assert client.post("/v1/embeddings", json={"images": ["p2.jpg"]}).status_code == 200
