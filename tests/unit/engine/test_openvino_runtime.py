"""OpenVINO as a candidate of the precision trial, on real towers converted here: it agrees with torch float32
for every family, a runtime that agrees but is slower is refused (timing injected), one faster by the margin
serves, and the converted IR is kept on disk: read again by a second worker or a restart, converted again for
other weights or another OpenVINO version."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.servers import CLIP_ARCH
from service.engine import loading, openvino_runtime, precision, probes
from service.engine.casting import FLOAT32, OPENVINO_BFLOAT16, OPENVINO_FLOAT32, OPENVINO_INT8, Numerics
from service.engine.loading import load_model
from service.engine.model import LoadedModel
from service.engine.types import INT8_ALLOW_COSINE, MIN_COSINE
from service.settings import Settings, SettingsError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(openvino_runtime.version() is None, reason="openvino not installed")]
AMX = frozenset({"avx2", "avx512f", "amx_bf16"})
AVX2 = frozenset({"avx2", "fma"})
RUNTIMES = ("openvino test",)


def converting(model: LoadedModel, directory: Path) -> LoadedModel:
    model.compiler = openvino_runtime.OpenVinoCompiler(directory, threads=1)
    return model


def resnet18(changed: bool = False) -> LoadedModel:
    model = load_model("resnet18", "random")
    if changed:  # other weights: one of them moved
        with torch.no_grad():
            next(model.module.parameters()).add_(0.01)
    return model


def timed_by(seconds: Callable[[Numerics, int], float]) -> precision.Timer:
    """A trial's clock: the real forward (its outputs are compared), the time ``seconds`` says."""
    def timer(tower: str, numerics: Numerics, size: int, run: Callable[[], Any]) -> tuple[Any, float]:
        return run(), seconds(numerics, size)
    return timer


def cosines(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).min())


# float32 first, then bfloat16 from the same IR: with one compiled-blob directory for both, OpenVINO read the
# float32 blob back for the bfloat16 compile and gave NaN rows
@pytest.mark.parametrize("name", ["resnet18", "timm:resnet18", f"open_clip:{CLIP_ARCH}", "open_clip:ViT-B-32"])
def test_a_converted_tower_agrees_with_torch_float32(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = converting(load_model(name, "random"), tmp_path)
    pixels = probes.probe_pixels(model.info.transform.crop_size)
    model.set_numerics("image", FLOAT32)
    reference = model.forward(pixels)
    for numerics in (OPENVINO_FLOAT32, OPENVINO_BFLOAT16):
        bound = 0.99999 if numerics == OPENVINO_FLOAT32 else MIN_COSINE
        model.set_numerics("image", numerics)
        got = model.forward(pixels)
        for want, have in zip(reference, got, strict=True):
            assert (want is None) == (have is None)
            if want is not None:
                assert have.shape == want.shape and have.dtype == torch.float32
                assert cosines(want, have) >= bound, (name, numerics.name)
        if reference[1] is not None:  # a classifier: the same top-1 class for every probe photo
            assert torch.equal(reference[1].argmax(1), got[1].argmax(1))


def test_a_torchscript_file_converts_too(tmp_path: Path) -> None:
    """A TorchScript file (``greenserve export``'s, or a user's): converted as scripted, not traced again."""
    plain = resnet18()
    path = tmp_path / "net.ts"
    with warnings.catch_warnings():  # torch calls TorchScript deprecated; users still bring such files
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(plain.module).save(str(path))
    model = converting(load_model("resnet18", str(path)), tmp_path / "ov")
    assert model.info.format == "torchscript"
    pixels = probes.probe_pixels(224, 4)
    reference = model.forward(pixels)
    model.set_numerics("image", OPENVINO_FLOAT32)
    got = model.forward(pixels)
    assert cosines(reference[0], got[0]) >= 0.99999 and cosines(reference[1], got[1]) >= 0.99999


def test_a_runtime_that_agrees_but_is_slower_is_refused(tmp_path: Path) -> None:
    model = converting(resnet18(), tmp_path)
    slow = {FLOAT32.name: 1.0, OPENVINO_BFLOAT16.name: 1.2, OPENVINO_FLOAT32.name: 0.95}
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=(1, 4), runtimes=RUNTIMES,
                              timer=timed_by(lambda n, size: slow.get(n.name, 0.5)))
    choice = chosen.towers[0]
    assert choice.numerics == "bfloat16 cast once" and not model.numerics_of("image").converted
    trials = {t.numerics: t for t in choice.trials}
    assert trials["openvino bfloat16"].agrees and not trials["openvino bfloat16"].kept((1, 4))
    assert "openvino bfloat16" in choice.reason and "agreed but slower" in choice.reason
    assert "openvino float32" in choice.reason and "not enough faster" in choice.reason


def test_a_runtime_faster_by_the_tie_margin_serves(tmp_path: Path) -> None:
    model = converting(resnet18(), tmp_path)
    fast = {FLOAT32.name: 1.0, OPENVINO_BFLOAT16.name: 0.2}
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=(1, 4), runtimes=RUNTIMES,
                              timer=timed_by(lambda n, size: fast.get(n.name, 0.5)))
    assert chosen.towers[0].numerics == "openvino bfloat16" and model.numerics_of("image") == OPENVINO_BFLOAT16
    assert not model.runs_module  # no preemption points to count
    crops = probes.probe_pixels(224, 3)
    assert model.forward(crops)[0].shape == (3, 512)


def test_without_native_bf16_openvino_float32_is_tried(tmp_path: Path) -> None:
    """An avx2-only CPU: no lower precision, but a faster runtime at float32 is a trial of its own."""
    model = converting(resnet18(), tmp_path)
    times = {FLOAT32.name: 1.0, OPENVINO_FLOAT32.name: 0.7}
    chosen = precision.settle(model, "auto", flags=AVX2, image_sizes=(1, 4), runtimes=RUNTIMES,
                              timer=timed_by(lambda n, size: times[n.name]))
    assert [t.numerics for t in chosen.towers[0].trials] == ["openvino float32"]
    assert chosen.towers[0].numerics == "openvino float32" and chosen.source == "measured"


def test_without_a_compiler_nothing_is_converted() -> None:
    model = resnet18()
    chosen = precision.settle(model, "auto", flags=AVX2)
    assert chosen.source == "hardware" and chosen.towers[0].numerics == "float32"


def test_the_ir_is_converted_once_and_read_back_by_a_second_worker(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="service.engine.openvino_runtime")
    first = converting(resnet18(), tmp_path)
    first.set_numerics("image", OPENVINO_FLOAT32)
    assert first.compiler is not None and first.compiler.conversions == 1  # type: ignore[attr-defined]
    assert "tower converted in" in caplog.text
    caplog.clear()
    # a sibling worker, or the same server after a restart: a new process's compiler on the same directory
    second = converting(resnet18(), tmp_path)
    second.set_numerics("image", OPENVINO_BFLOAT16)
    assert second.compiler.conversions == 0  # type: ignore[union-attr]
    assert "read from the disk cache" in caplog.text and "tower converted in" not in caplog.text
    assert len([p for p in tmp_path.iterdir() if p.name != "compiled"]) == 1


def test_other_weights_or_another_openvino_convert_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    converting(resnet18(), tmp_path).set_numerics("image", OPENVINO_FLOAT32)
    other = converting(resnet18(changed=True), tmp_path)
    other.set_numerics("image", OPENVINO_FLOAT32)
    assert other.compiler.conversions == 1  # type: ignore[union-attr]
    monkeypatch.setattr(openvino_runtime, "version", lambda: "9999.0")
    upgraded = converting(resnet18(), tmp_path)
    upgraded.set_numerics("image", OPENVINO_FLOAT32)
    assert upgraded.compiler.conversions == 1  # type: ignore[union-attr]
    assert len([p for p in tmp_path.iterdir() if p.name != "compiled"]) == 3


def test_the_served_choice_drops_the_conversions_it_does_not_serve(tmp_path: Path) -> None:
    model = converting(resnet18(), tmp_path)
    model.set_numerics("image", OPENVINO_FLOAT32)
    model.set_numerics("image", OPENVINO_BFLOAT16)
    model.release_float32()
    assert list(model._converted) == ["openvino bfloat16"]
    assert np.isfinite(model.forward(probes.probe_pixels(224, 2))[1].numpy()).all()


def test_a_text_tower_is_not_converted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = converting(load_model(f"open_clip:{CLIP_ARCH}", "random"), tmp_path)
    with pytest.raises(NotImplementedError, match="text tower"):
        model.set_numerics("text", OPENVINO_FLOAT32)
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=(1, 4), text_sizes=(1, 4), runtimes=RUNTIMES,
                              timer=timed_by(lambda n, size: 0.5 if n.name.startswith("openvino") else 1.0))
    text = chosen.tower("text")
    assert text is not None and text.reason.endswith(precision.TEXT_ON_TORCH) and "text tower" in chosen.reason
    assert not any(t.numerics.startswith("openvino") for t in text.trials)  # stays on torch, and says why


def test_converting_forks_nothing_and_sends_no_telemetry(tmp_path: Path) -> None:
    """OpenVINO's converter forks (multiprocessing) to report to Google Analytics; in a gunicorn worker each fork
    carried on as a copy of the worker. A fresh process, as a worker is: no fork while it converts."""
    script = f"""
import os, warnings
warnings.simplefilter("ignore")
forks = []
real = os.fork
os.fork = lambda: forks.append(1) or real()
from pathlib import Path
from service.engine import openvino_runtime
from service.engine.casting import OPENVINO_FLOAT32
from service.engine.loading import load_model
model = load_model("resnet18", "random")
model.compiler = openvino_runtime.OpenVinoCompiler(Path({str(tmp_path)!r}), 1)
model.set_numerics("image", OPENVINO_FLOAT32)
import sys
print("forks", len(forks), "telemetry", sys.modules.get("openvino_telemetry"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "forks 0 telemetry None" in done.stdout


@pytest.mark.parametrize(("model", "runtimes", "converts"), [
    ("resnet18", "auto", True), (f"open_clip:{CLIP_ARCH}", "auto", False), (f"open_clip:{CLIP_ARCH}", "openvino", True),
    ("resnet18", "torch", False)])
def test_auto_leaves_a_model_with_a_text_tower_on_torch(model: str, runtimes: str, converts: bool,
                                                        tmp_path: Path) -> None:
    """A CLIP's searches run between the blocks of its torch image forward; a converted one has none."""
    settings = Settings.from_env({"GREENSERVE_RUNTIMES": runtimes, "GREENSERVE_CACHE_DIR": str(tmp_path)})
    loaded = load_model(model, "random")
    assert bool(loading._converters(settings, loaded)) == converts
    assert (loaded.compiler is not None) == converts


def test_an_int8_candidate_below_the_stated_bound_is_refused(tmp_path: Path) -> None:
    """int8 only where the operator allows it, and never below the agreement they stated, however fast."""
    pytest.importorskip("nncf")
    model = converting(resnet18(), tmp_path)
    fast = {FLOAT32.name: 1.0, OPENVINO_INT8.name: 0.05}
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=(1, 4), runtimes=RUNTIMES,
                              int8_min_cosine=0.9999999, timer=timed_by(lambda n, size: fast.get(n.name, 0.9)))
    trial = next(t for t in chosen.towers[0].trials if t.numerics == "openvino int8")
    assert not trial.agrees and trial.min_cosine is not None and trial.min_cosine < 0.9999999
    assert chosen.towers[0].numerics != "openvino int8" and "openvino int8" in chosen.towers[0].reason
    assert trial.public()["min_cosine_bound"] == 0.9999999


def test_int8_allowed_serves_when_it_keeps_the_bound_and_says_its_agreement(tmp_path: Path) -> None:
    pytest.importorskip("nncf")
    model = converting(resnet18(), tmp_path)
    fast = {FLOAT32.name: 1.0, OPENVINO_INT8.name: 0.1}
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=(1, 4), runtimes=RUNTIMES,
                              int8_min_cosine=INT8_ALLOW_COSINE, timer=timed_by(lambda n, size: fast.get(n.name, 0.9)))
    choice = chosen.towers[0]
    trial = next(t for t in choice.trials if t.numerics == "openvino int8")
    assert choice.numerics == "openvino int8", choice.reason
    assert trial.min_cosine is not None and trial.min_cosine >= INT8_ALLOW_COSINE and trial.top1_same == trial.compared
    assert "needs >= 0.999)" in choice.reason
    # the embeddings (what the bound is about) of photos neither calibrated on nor compared in the trial
    pixels = probes.probe_pixels(224, 4, seed=2)
    model.set_numerics("image", FLOAT32)
    reference = model.forward(pixels)[0]
    model.set_numerics("image", OPENVINO_INT8)
    assert cosines(reference, model.forward(pixels)[0]) >= INT8_ALLOW_COSINE


@pytest.mark.parametrize(("value", "ok"), [("off", True), ("allow", True), ("0.995", True), ("yes", False),
                                           ("1.5", False), ("0", False)])
def test_greenserve_int8_is_off_allow_or_a_cosine(value: str, ok: bool) -> None:
    if ok:
        Settings.from_env({"GREENSERVE_INT8": value})
    else:
        with pytest.raises(SettingsError, match="GREENSERVE_INT8"):
            Settings.from_env({"GREENSERVE_INT8": value})


def test_a_tower_openvino_cannot_take_stays_on_torch_with_the_reason(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the converter raises (its own exception types too), the trial refuses the way and says why."""
    class ConversionFailure(Exception):
        pass

    def fail(*args: Any) -> Path:
        raise ConversionFailure("an op without a conversion rule")

    monkeypatch.setattr(openvino_runtime.OpenVinoCompiler, "_ir", fail)
    model = converting(resnet18(), tmp_path)
    chosen = precision.settle(model, "auto", flags=AMX, image_sizes=(1, 4), runtimes=RUNTIMES)
    choice = chosen.towers[0]
    assert not choice.numerics.startswith("openvino") and model.runs_module
    assert "OpenVINO cannot run this tower: ConversionFailure: an op without a conversion rule" in choice.reason
