"""Model loading for every GREENSERVE_WEIGHTS mode, on a small real torchvision model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from service.engine import torchvision_family as model_mod
from service.engine.casting import Numerics
from service.engine.loading import load_model
from service.engine.torchvision_family import split_head
from service.engine.types import ModelLoadError

pytestmark = pytest.mark.slow  # real models: not in make test-fast

NAME = "resnet18"


def batch(n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, 224, 224, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(7)
    net = torchvision.models.resnet18(weights=None).eval()
    path = tmp_path_factory.mktemp("w") / "r18.pt"
    torch.save(net.state_dict(), path)
    return path, net


def test_state_dict_file_gives_embeddings_and_imagenet_labels(saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, net = saved_state
    m = load_model(NAME, str(path), channels_last=False)
    assert m.info.tasks == ("embeddings", "classify")
    assert m.info.embedding_dim == 512
    assert m.info.labels[281] == "tabby"
    assert m.info.weights == str(path)
    feats, logits = m.forward(batch())
    assert feats.shape == (2, 512) and logits.shape == (2, 1000)


def test_state_dict_outputs_match_the_saved_network(saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, net = saved_state
    m = load_model(NAME, str(path), channels_last=True)
    pixels = batch()
    _, logits = m.forward(pixels)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - mean) / std
    with torch.inference_mode():
        expected = net(x)
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)


def test_state_dict_is_memory_mapped_not_copied(saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved_state
    m = load_model(NAME, str(path), channels_last=False)
    ptr = m.module.backbone.layer1[0].conv1.weight.data_ptr()
    # assign=True adopts the tensors torch.load mapped from the file: they live inside its mapping
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            mapped.append((lo, hi))
    assert any(lo <= ptr < hi for lo, hi in mapped)


JIT_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")


@JIT_DEPRECATED
def test_torchscript_file_loads(tmp_path: Path, saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved_state
    m = load_model(NAME, str(path), channels_last=False)
    ts_path = tmp_path / "r18.ts"
    torch.jit.script(m.module).save(str(ts_path))
    ts = load_model(NAME, str(ts_path))
    assert ts.info.format == "torchscript"
    assert ts.info.embedding_dim == 512
    pixels = batch()
    torch.testing.assert_close(ts.forward(pixels)[1], m.forward(pixels)[1], atol=1e-3, rtol=1e-3)


@JIT_DEPRECATED
def test_torchscript_classifier_without_features_serves_classify_only(tmp_path: Path) -> None:
    net = torchvision.models.resnet18(weights=None).eval()
    ts_path = tmp_path / "plain.ts"
    torch.jit.script(net).save(str(ts_path))
    m = load_model(NAME, str(ts_path))
    assert m.info.tasks == ("classify",) and m.info.embedding_dim is None


def test_random_weights_are_seeded_and_labelled_random() -> None:
    a = load_model(NAME, "random")
    b = load_model(NAME, "random")
    assert a.info.weights == "random"
    np.testing.assert_allclose(a.forward(batch(1))[0], b.forward(batch(1))[0], atol=1e-5)


def test_auto_without_cache_falls_back_to_random(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    assert load_model(NAME, "auto").info.weights == "random"


def test_imagenet_without_cache_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(ModelLoadError, match="download-weights"):
        load_model(NAME, "imagenet")


def test_imagenet_and_auto_use_the_cached_pretrained_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved_state
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    assert model_mod.cached_weights_path(NAME) is None
    url = torchvision.models.get_model_weights(NAME).DEFAULT.url
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / url.rsplit("/", 1)[1]).write_bytes(path.read_bytes())
    for mode in ("imagenet", "auto"):
        assert load_model(NAME, mode).info.weights == "imagenet"


def test_fine_tuned_head_size_is_taken_from_the_file(tmp_path: Path) -> None:
    net = torchvision.models.resnet18(weights=None, num_classes=7)
    path = tmp_path / "ft.pt"
    torch.save({"state_dict": net.state_dict()}, path)
    m = load_model(NAME, str(path))
    assert len(m.info.labels) == 7 and m.info.labels[0] == "class_0"


def test_wrong_architecture_file_names_the_fix(saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved_state
    with pytest.raises(ModelLoadError, match="GREENSERVE_MODEL"):
        load_model("resnet34", str(path))


def test_unknown_model_name_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="not a torchvision classification model"):
        load_model("resnet9000", "random")


def test_split_head_cuts_at_the_last_linear() -> None:
    net = torchvision.models.mobilenet_v3_small(weights=None)
    split = split_head(net)
    assert split.head.out_features == 1000 and split.head.in_features == 1024


def _in_file_mapping(ptr: int, path: Path) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def test_exported_checkpoint_stays_mapped_in_channels_last(tmp_path: Path,
                                                           saved_state: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved_state
    out = tmp_path / "r18-export.pt"
    model_mod.export_checkpoint(NAME, str(path), str(out))
    plain = load_model(NAME, str(path), channels_last=True)
    exported = load_model(NAME, str(out), channels_last=True)
    conv_plain = plain.module.backbone.layer1[0].conv1.weight
    conv_exported = exported.module.backbone.layer1[0].conv1.weight
    assert conv_exported.is_contiguous(memory_format=torch.channels_last)
    assert _in_file_mapping(conv_exported.data_ptr(), out), "exported weights were copied at load"
    assert not _in_file_mapping(conv_plain.data_ptr(), path), "expected a private channels_last copy"
    pixels = batch()
    torch.testing.assert_close(exported.forward(pixels)[0], plain.forward(pixels)[0])


@pytest.mark.parametrize("cast", [False, True], ids=["autocast", "cast once"])
def test_bfloat16_embeddings_stay_within_tolerance(saved_state: tuple[Path, torch.nn.Module], cast: bool) -> None:
    path, _ = saved_state
    fp32 = load_model(NAME, str(path))
    bf16 = load_model(NAME, str(path), numerics=Numerics(torch.bfloat16, cast=cast))
    assert bf16.info.dtype == "bfloat16"
    pixels = batch(4)
    cos = torch.nn.functional.cosine_similarity(fp32.forward(pixels)[0], bf16.forward(pixels)[0])
    assert float(cos.min()) > 0.999


def test_rejoin_puts_the_head_back_where_it_was_and_nowhere_else() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Identity(), torch.nn.Linear(4, 2))
    keys = set(net.state_dict())
    split = split_head(net)
    rejoined = model_mod._rejoin_head(split)
    assert isinstance(rejoined[1], torch.nn.Identity)  # an unrelated Identity stays an Identity
    assert set(rejoined.state_dict()) == keys
