"""The CPU's real limit, per runtime: ``python -m bench.runtimes [--models resnet50,open_clip:ViT-B-32] [--rounds 5]``.

Each model's image tower alone (seeded random weights, as served: convnets in channels_last), no server, on
photo-like crops (the album's renderer, the model's own resize, crop and normalisation). Every variant runs
the same mixed sequence of batch sizes a batcher forms (``SIZES``), on ``--threads`` threads, and the variants
take turns round by round, so a shared machine's drift lands on all alike. Measured:

- torch float32, and torch bfloat16 with the weights cast once (what greenserve serves on a bf16 CPU today)
- ONNX Runtime float32 (the tower exported to ONNX with a dynamic batch), and in int8: weights only (dynamic) and
  weights and activations calibrated on the crops (static, QDQ)
- OpenVINO float32, bfloat16 (``INFERENCE_PRECISION_HINT``) and int8 (the static QDQ model), converted from the
  same ONNX files, CPU pinning off (pre-forked workers share the cores), one stream, ``--threads`` threads; its
  conversion and compile times, first and from its compiled-model cache (``CACHE_DIR``)

Prints the command, the machine (its CPU flags say whether it has native bf16) and a table: images/s (the best
round), the ratio to today's choice, and the agreement with torch float32 over every crop (min cosine, top-1
agreement of the outputs: a classifier's classes; for a CLIP tower, its largest feature, a rough check). Static int8
is calibrated on the same crops it is compared on: its agreement is a best case. A variant that cannot be built
here is a row that says why. Writes bench/out/runtimes.json. OpenVINO comes with the bench extra
(``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import copy
import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench import bare
from bench.album import Photo, render
from bench.report import rows_table, start, write_json
from harness.launch import ROOT
from service.engine import openvino_runtime
from service.engine.loading import parse_model_name

OUT = ROOT / "bench" / "out"
SIZES = (1, 4, 2, 8, 16, 3, 32, 6, 12, 24)  # a batcher's mix: one sequence is 108 images
CROPS = 32  # distinct crops; a batch of n takes the first n
TODAY = "torch bfloat16 (cast once)"
Run = Callable[[np.ndarray], np.ndarray]


def tower(model: str) -> tuple[torch.nn.Module, int, tuple[float, ...], tuple[float, ...]]:
    """The image tower, its crop size and normalisation, from the same seeded weights as the other benches."""
    family, arch = parse_model_name(model)
    weights = bare.save_random_weights(model, OUT / "weights" / f"{bare.slug(model)}-seed0.pt")
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if family == "open_clip":
        import open_clip

        clip = open_clip.create_model(arch, pretrained=None)
        clip.load_state_dict(state)
        visual = clip.visual.eval()
        return visual, visual.image_size[0], tuple(open_clip.OPENAI_DATASET_MEAN), tuple(open_clip.OPENAI_DATASET_STD)
    import torchvision

    net = torchvision.models.get_model(arch, weights=None)
    net.load_state_dict(state)
    return (net.eval().to(memory_format=torch.channels_last), 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def crops(size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``CROPS`` photo-like crops, normalised: (CROPS, 3, size, size) float32."""
    out = []
    for i in range(CROPS):
        img = Image.open(io.BytesIO(render(Photo(f"p{i}.jpg", 640 + 32 * (i % 5), 480, 1, seed=900 + i))))
        w, h = img.size
        scale = size / min(w, h)
        img = img.convert("RGB").resize((round(w * scale), round(h * scale)), Image.Resampling.BICUBIC)
        left, top = (img.width - size) // 2, (img.height - size) // 2
        pixels = np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.float32) / 255.0
        out.append(((pixels - mean) / std).transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(out), dtype=np.float32)


def torch_runs(net: torch.nn.Module, threads: int, convnet: bool) -> dict[str, Run]:
    torch.set_num_threads(threads)
    fmt = torch.channels_last if convnet else torch.contiguous_format
    cast = copy.deepcopy(net).to(torch.bfloat16)

    def f32(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return net(torch.from_numpy(x).contiguous(memory_format=fmt)).numpy()

    def bf16(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return cast(torch.from_numpy(x).to(torch.bfloat16).contiguous(memory_format=fmt)).float().numpy()

    return {"torch float32": f32, TODAY: bf16}


def export(net: torch.nn.Module, size: int, directory: Path) -> Path:
    path = directory / "tower.onnx"
    example = torch.zeros(2, 3, size, size)
    torch.onnx.export(net, (example,), str(path), input_names=["image"], output_names=["out"],
                      dynamic_axes={"image": {0: "batch"}, "out": {0: "batch"}}, opset_version=17, dynamo=False)
    return path


class Crops:
    """ONNX Runtime's calibration reader: the crops, a few at a time."""

    def __init__(self, x: np.ndarray) -> None:
        self._batches = iter(np.split(x, 4))

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {"image": batch}


def quantised(onnx_path: Path, x: np.ndarray) -> dict[str, Path | str]:
    """The tower in int8: weights only (dynamic), and weights and activations calibrated on the crops (static,
    QDQ: ONNX Runtime and OpenVINO both run it in int8)."""
    try:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static
    except ImportError as exc:
        return {"int8": f"not installed ({exc})"}
    out: dict[str, Path | str] = {}
    dynamic, static = onnx_path.with_name("tower-int8-dynamic.onnx"), onnx_path.with_name("tower-int8-static.onnx")
    try:
        quantize_dynamic(str(onnx_path), str(dynamic), weight_type=QuantType.QInt8)
        out["dynamic"] = dynamic
    except Exception as exc:
        out["dynamic"] = _why(exc)
    try:
        quantize_static(str(onnx_path), str(static), Crops(x), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                        calibrate_method=CalibrationMethod.MinMax)
        out["static"] = static
    except Exception as exc:
        out["static"] = _why(exc)
    return out


def ort_runs(onnx_path: Path, int8: dict[str, Path | str], threads: int) -> dict[str, Run | str]:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"onnxruntime float32": f"not installed ({exc})"}
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    out: dict[str, Run | str] = {}
    for name, path in (("onnxruntime float32", onnx_path), ("onnxruntime int8 (dynamic)", int8.get("dynamic")),
                       ("onnxruntime int8 (static)", int8.get("static"))):
        if not isinstance(path, Path):
            out[name] = str(path)
            continue
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            out[name] = lambda x, s=session: s.run(None, {"image": x})[0]
        except Exception as exc:  # a runtime that cannot take this tower: the row says why
            out[name] = _why(exc)
    return out


def openvino_runs(onnx_path: Path, int8: dict[str, Path | str], threads: int,
                  compile_s: dict[str, dict[str, float]]) -> dict[str, Run | str]:
    """OpenVINO float32, bfloat16 and int8 (the static QDQ model), each compiled twice: the first time, and again
    from the compiled blob ``CACHE_DIR`` kept (what a sibling worker or a restart would pay)."""
    try:
        openvino_runtime.without_telemetry()  # no Google Analytics from a benchmark either
        import openvino as ov
    except ImportError as exc:
        return {"openvino": f"not installed ({exc}); pip install -e .[bench]"}
    out: dict[str, Run | str] = {}
    variants = (("openvino float32", onnx_path, "f32"), ("openvino bfloat16", onnx_path, "bf16"),
                ("openvino int8 (static QDQ)", int8.get("static"), None))
    for name, path, precision in variants:
        if not isinstance(path, Path):
            out[name] = str(path)
            continue
        try:
            t0 = time.perf_counter()
            ir = path.with_name(f"{path.stem}-{precision or 'int8'}.xml")
            ov.save_model(ov.convert_model(str(path)), str(ir))
            convert = time.perf_counter() - t0
            config = {"ENABLE_CPU_PINNING": False, "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
                      "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": str(path.parent / f"cache-{ir.stem}")}
            if precision:
                config["INFERENCE_PRECISION_HINT"] = precision
            timings = {"convert_s": round(convert, 2)}
            for when in ("first", "cached"):
                t0 = time.perf_counter()
                compiled = ov.Core().compile_model(str(ir), "CPU", config)
                timings[f"compile_{when}_s"] = round(time.perf_counter() - t0, 2)
            compile_s[name] = timings
            request = compiled.create_infer_request()
            out[name] = lambda x, r=request: np.array(r.infer({0: x})[0], copy=True)
        except Exception as exc:
            out[name] = _why(exc)
    return out


def _why(exc: Exception) -> str:
    """A variant that could not be built or run here, in its row's words."""
    return f"{type(exc).__name__}: {str(exc)[:160]}"


def agreement(reference: np.ndarray, got: np.ndarray) -> dict[str, float]:
    a, b = reference.reshape(len(reference), -1), got.reshape(len(got), -1)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min_cosine": round(float(cos.min()), 6), "mean_cosine": round(float(cos.mean()), 6),
            "top1_agree": round(float((a.argmax(1) == b.argmax(1)).mean()), 3)}


def sequence_seconds(run: Run, x: np.ndarray) -> float:
    t0 = time.perf_counter()
    for n in SIZES:
        run(x[:n])
    return time.perf_counter() - t0


def measure(model: str, rounds: int, threads: int) -> list[dict[str, Any]]:
    net, size, mean, std = tower(model)
    x = crops(size, mean, std)
    runs: dict[str, Run | str] = dict(torch_runs(net, threads, convnet=parse_model_name(model)[0] != "open_clip"))
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export(net, size, Path(tmp))
        int8 = quantised(onnx_path, x)
        compile_s: dict[str, dict[str, float]] = {}
        runs.update(ort_runs(onnx_path, int8, threads))
        runs.update(openvino_runs(onnx_path, int8, threads, compile_s))
        ready = {name: run for name, run in runs.items() if callable(run)}
        reference = ready["torch float32"](x)
        checks = {name: agreement(reference, run(x)) for name, run in ready.items()}
        for run in ready.values():  # warm: each shape once
            sequence_seconds(run, x)
        best = dict.fromkeys(ready, float("inf"))
        for r in range(rounds):
            order = list(ready) if r % 2 == 0 else list(reversed(ready))
            for name in order:
                best[name] = min(best[name], sequence_seconds(ready[name], x))
    images = sum(SIZES)
    today = images / best[TODAY] if TODAY in best else None
    rows = []
    for name, way in runs.items():
        if not callable(way):
            rows.append({"model": model, "runtime": name, "images/s": None, "x today": None, "why not": way})
            continue
        rate = images / best[name]
        rows.append({"model": model, "runtime": name, "images/s": round(rate, 1),
                     "x today": round(rate / today, 2) if today else None, **checks[name],
                     **compile_s.get(name, {})})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,open_clip:ViT-B-32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="threads per variant (default: the 2 cores)")
    args = parser.parse_args(argv)
    info = start("bench.runtimes", args.models, argv)
    rows = [row for model in args.models.split(",") for row in measure(model, args.rounds, args.threads)]
    timed = ("model", "runtime", "images/s", "x today", "min_cosine", "mean_cosine", "top1_agree")
    print(rows_table([{k: row[k] for k in timed} for row in rows if row["images/s"]]))
    started = ("model", "runtime", "convert_s", "compile_first_s", "compile_cached_s")
    print(rows_table([{k: row[k] for k in started} for row in rows if "convert_s" in row]))
    for row in rows:
        if not row["images/s"]:
            print(f"{row['model']} {row['runtime']}: {row['why not']}")
    write_json(OUT / "runtimes.json", {"machine": info, "sizes": SIZES, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
