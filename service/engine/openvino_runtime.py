"""OpenVINO as a runtime for an image tower, a candidate of the precision trial (``precision``):

    convert   the loaded torch module, traced at float32, to OpenVINO's IR: once per host and weights, kept
              under the disk cache (``<cache>/openvino/<key>``), the key a digest of the tower's tensors, its
              class, its input size and the torch and OpenVINO versions; a sibling worker or a restart reads it
    compile   per worker, for its CPU in float32 or bfloat16, with the input taken as it leaves the decoder
              (uint8, NHWC) and normalised by the model's first op; OpenVINO keeps the compiled blob in
              ``<cache>/openvino/compiled/<precision>`` (its own key: the IR, the device, the config, its
              version; one directory per precision: sharing one, a bfloat16 compile after a float32 one of the
              same IR read float32's blob back and gave NaN rows, OpenVINO 2026.4)
    run       from the worker's inference thread: ``infer`` releases the GIL, as torch's forward does

Its threads are fixed when compiled (the worker's share of the cores: ``GREENSERVE_BORROW_IDLE_CORES`` does not
apply), and its CPU pinning is off: pinned, two pre-forked workers ran at one core's speed. A converted
forward has no preemption points. Figures: docs/BENCHMARKS.md#runtimes-served; each tower alone:
docs/history/runtimes.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from service.engine.casting import OPENVINO, Numerics
from service.engine.probes import probe_pixels
from service.engine.types import Transform

log = logging.getLogger(__name__)

IR_NAME = "tower.xml"
CALIBRATION_PHOTOS = 32  # NNCF's statistics for int8: photo-like probes, not the ones the trial compares
PRECISION_HINTS = {torch.float32: "f32", torch.bfloat16: "bf16"}


def version() -> str | None:
    """OpenVINO's version where it is installed, else None (the trial then tries torch only)."""
    return _installed("openvino")


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def without_telemetry() -> None:
    """OpenVINO's converter reports its import and every conversion to Google Analytics (unless the host
    opted out) from processes it forks with ``multiprocessing``: in a gunicorn worker each fork copied the
    worker, which went on loading its model six times over. The server never phones home: with its telemetry
    package unimportable, OpenVINO uses its own stand-in (``openvino.tools.ovc.telemetry_stub``). Before
    OpenVINO's first import in the process."""
    if "openvino_telemetry" not in sys.modules:
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]  # import raises ImportError


class ConvertedTower:
    """A compiled tower: ``(uint8 NHWC crops) -> one output, or a tuple`` as the torch module returns them."""

    def __init__(self, compiled: Any) -> None:
        self._request = compiled.create_infer_request()
        self._outputs = len(compiled.outputs)

    def __call__(self, nhwc: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        results = self._request.infer({0: np.ascontiguousarray(nhwc.numpy())})
        # the request reuses its output buffers on the next call: the rows leave as copies
        out = tuple(torch.from_numpy(np.array(results[i], copy=True)) for i in range(self._outputs))
        return out[0] if len(out) == 1 else out


class OpenVinoCompiler:
    """Converts and compiles image towers under ``directory`` (the disk cache's ``openvino/``) for ``threads``
    inference threads."""

    runtime = OPENVINO

    def __init__(self, directory: Path, threads: int) -> None:
        without_telemetry()
        import openvino as ov  # here: a server without OpenVINO never imports it

        self._ov = ov
        self.directory, self.threads = directory, threads
        self._core = ov.Core()
        self.conversions = 0  # IRs this process converted (not read from the cache): tests, and the log
        # each tower's key, hashed once: a trial compiles it two or three times (0.26 s per hash for a
        # ViT-B/32), and a compiler belongs to one model, whose weights do not change while it converts
        self._keys: dict[tuple[int, int], str] = {}

    def key(self, module: nn.Module, root: nn.Module, skip: tuple[str, ...], size: int) -> str:
        """What a converted IR depends on: the tower's tensors (every byte, in float32), its class, its input size
        and the versions that trace and convert it."""
        digest = hashlib.sha256()
        digest.update(f"{type(module).__qualname__} {size} torch {torch.__version__} openvino {version()}".encode())
        with torch.no_grad():
            for name, t in (*root.named_parameters(), *root.named_buffers()):
                if name.startswith(skip):
                    continue
                digest.update(name.encode())
                digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
        return digest.hexdigest()[:32]

    def compile(self, module: nn.Module, root: tuple[nn.Module, tuple[str, ...]], transform: Transform,
                numerics: Numerics) -> Callable[[torch.Tensor], Any]:
        """``module`` (the image tower in float32) as OpenVINO runs it in ``numerics.dtype``."""
        size = transform.crop_size
        try:
            tower = (id(root[0]), size)
            if tower not in self._keys:
                self._keys[tower] = self.key(module, root[0], root[1], size)
            key = self._keys[tower]
            ir = self._ir(module, key, size)
            if numerics.dtype == torch.int8:
                ir = self._int8(ir, key, transform)
            model = self._core.read_model(str(ir))
            self._preprocess(model, transform)
            started = time.perf_counter()
            hint = PRECISION_HINTS.get(numerics.dtype)  # int8: the rest in the CPU's own default
            compiled = self._core.compile_model(model, "CPU", {
                "ENABLE_CPU_PINNING": False, "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": self.threads,
                "PERFORMANCE_HINT": "LATENCY", **({"INFERENCE_PRECISION_HINT": hint} if hint else {}),
                "CACHE_DIR": str(self.directory / "compiled" / (hint or "int8"))})
            log.info("openvino: the image tower compiled for %s in %.2fs", numerics.name, time.perf_counter() - started)
        except Exception as exc:  # any failure to convert, quantise or compile: the trial refuses it, saying why
            raise RuntimeError(f"OpenVINO cannot run this tower: {type(exc).__name__}: {str(exc)[:300]}") from exc
        return ConvertedTower(compiled)

    def _ir(self, module: nn.Module, key: str, size: int) -> Path:
        """The tower's IR under ``key``: from the cache, else converted now and saved (by rename: a sibling
        converting at once keeps one of two equal files)."""
        kept = self.directory / key
        if (kept / IR_NAME).exists():
            log.info("openvino: the image tower's IR read from the disk cache (%s)", kept)
            return kept / IR_NAME
        started = time.perf_counter()
        example = torch.zeros(2, 3, size, size)
        with torch.no_grad(), warnings.catch_warnings():
            # traced here, without trace checks: OpenVINO's own tracing rejects open_clip's towers, whose graphs
            # differ between two traces by names only. torch calls tracing deprecated (FutureWarning) and warns
            # of every Python branch it fixes (TracerWarning): the batch size is the only shape that varies,
            # and the trial compares the outcome with torch's at several
            warnings.simplefilter("ignore")
            traced = module if isinstance(module, torch.jit.ScriptModule) else torch.jit.trace(  # type: ignore[no-untyped-call]  # torch.jit is untyped
                module, example, check_trace=False)
            model = self._ov.convert_model(traced, example_input=example)
        model.reshape({0: self._ov.PartialShape([-1, 3, size, size])})
        self._save(model, kept)
        self.conversions += 1
        log.info("openvino: the image tower converted in %.1fs, kept in %s", time.perf_counter() - started, kept)
        return kept / IR_NAME

    def _int8(self, ir: Path, key: str, transform: Transform) -> Path:
        """The IR quantised to int8 by NNCF (weights and activations, calibrated on photo-like probes other than
        the trial's), kept beside the float32 one under what the calibration depends on besides it."""
        calibration = f"{transform.mean} {transform.std} {CALIBRATION_PHOTOS} nncf {_installed('nncf')}"
        kept = self.directory / f"{key}-int8-{hashlib.sha256(calibration.encode()).hexdigest()[:12]}"
        if (kept / IR_NAME).exists():
            log.info("openvino: the image tower's int8 IR read from the disk cache (%s)", kept)
            return kept / IR_NAME
        try:
            import nncf  # the int8 extra: imported only when GREENSERVE_INT8 asks for it
        except ImportError as exc:
            raise RuntimeError("GREENSERVE_INT8 needs NNCF: pip install greenserve[int8]") from exc
        started = time.perf_counter()
        pixels = probe_pixels(transform.crop_size, CALIBRATION_PHOTOS, seed=1).astype(np.float32).transpose(0, 3, 1, 2)
        mean = np.array(transform.mean, np.float32).reshape(1, 3, 1, 1) * 255
        std = np.array(transform.std, np.float32).reshape(1, 3, 1, 1) * 255
        photos = [((pixels[i:i + 1] - mean) / std) for i in range(CALIBRATION_PHOTOS)]
        quantised = nncf.quantize(self._core.read_model(str(ir)), nncf.Dataset(photos), subset_size=CALIBRATION_PHOTOS)
        self._save(quantised, kept)
        log.info("openvino: the image tower quantised to int8 in %.1fs, kept in %s", time.perf_counter() - started, kept)
        return kept / IR_NAME

    def _save(self, model: Any, kept: Path) -> None:
        """Saved under a name of its own, then renamed: a sibling doing the same at once keeps one of two equal."""
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        self._ov.save_model(model, str(partial / IR_NAME), compress_to_fp16=False)
        try:
            partial.rename(kept)
        except OSError:  # a sibling's rename came first
            shutil.rmtree(partial, ignore_errors=True)

    def _preprocess(self, model: Any, transform: Transform) -> None:
        """The compiled model takes the decoder's uint8 NHWC crops and normalises them itself (one fused op
        instead of torch's float copy and two passes)."""
        from openvino.preprocess import PrePostProcessor

        ppp = PrePostProcessor(model)
        ppp.input().tensor().set_element_type(self._ov.Type.u8).set_layout(self._ov.Layout("NHWC"))
        ppp.input().model().set_layout(self._ov.Layout("NCHW"))
        ppp.input().preprocess().convert_element_type(self._ov.Type.f32) \
            .mean([m * 255 for m in transform.mean]).scale([s * 255 for s in transform.std])
        ppp.build()
