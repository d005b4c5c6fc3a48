"""bench.gpu_check's pure parts: the layouts, the budget and the plan (which steps fit, which run, which are skipped), and
the Markdown tables and goal lines built from its results document. Nothing here needs torch or a GPU."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GOAL_IMAGES_PER_S = 1100  # resnet50 phone photos/s on one H200
BEFORE_IMAGES_PER_S = 274  # what 2 workers served with Pillow decode on the CPU (docs/BENCHMARKS.md)
DTYPES = ("auto", "float32", "bfloat16", "float16")
JPEG = ("device", "pillow", "auto")
PHASE_SECTIONS = {"1 model": ("model_level", "decode"), "2 server": ("server",), "3 oom": ("oom",),
                  "4 layouts": ("layouts", "bare")}


class Skip(Exception):
    """A step with nothing to do (its layout was measured already, no layout to take the best of)."""


@dataclass(frozen=True)
class Layout:
    """``DEVICE:WORKERS[:DECODE[:DTYPE[:JPEG]]]`` (cuda, cpu) or ``bare:PxT[:DTYPE]``.

    WORKERS: a number or ``best`` (the workers of the best images/s measured on that device so far);
    DECODE: decode threads, 0 = the server's default, ``2x`` = twice the default; JPEG: device | pillow |
    auto | ``-`` (not set). cuda defaults to dtype auto and device decode, cpu to auto and no JPEG setting.
    ``WORKERS:DECODE:DTYPE`` (the earlier form) is a cuda layout.
    """

    device: str
    workers: int | str
    decode: int | str = 0
    dtype: str | None = "auto"
    jpeg: str | None = None
    threads: int = 1  # bare: torch threads per process

    @property
    def label(self) -> str:
        if self.device == "bare":
            return f"bare {self.workers}x{self.threads} {self.dtype}"
        decode = f"decode {self.decode}" if self.decode else "decode default"
        workers = f"{self.workers} worker" + ("" if self.workers == 1 else "s")
        return f"{self.device} {workers}, {decode}, dtype {self.dtype or '-'}, jpeg {self.jpeg or '-'}"


def parse_layout(spec: str) -> Layout:
    parts = spec.strip().split(":")
    if parts[0].isdigit():  # the earlier WORKERS:DECODE:DTYPE form: a cuda layout
        parts = ["cuda", *parts]
    device = parts[0]
    if device == "bare":
        m = re.fullmatch(r"(\d+)x(\d+)", parts[1] if len(parts) > 1 else "")
        if not m or len(parts) > 3 or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"{spec!r}: a bare layout is bare:PROCESSESxTHREADS[:DTYPE]")
        dtype = parts[2] if len(parts) > 2 else "float32"
        _check(dtype in DTYPES, spec, f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return Layout("bare", int(m.group(1)), dtype=dtype, threads=int(m.group(2)))
    _check(device in ("cuda", "cpu") and 2 <= len(parts) <= 5, spec, "expected DEVICE:WORKERS[:DECODE[:DTYPE[:JPEG]]]")
    workers, decode, dtype, jpeg = (parts[1:] + ["0", "auto", "device" if device == "cuda" else "-"][len(parts) - 2:])
    _check(workers == "best" or workers.isdigit() and int(workers) >= 1, spec, f"workers {workers!r}")
    _check(bool(re.fullmatch(r"\d+|\d+x", decode)), spec, f"decode threads {decode!r} (N or Nx)")
    _check(dtype in DTYPES, spec, f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    _check(jpeg in (*JPEG, "-"), spec, f"jpeg decode {jpeg!r} is not one of {', '.join(JPEG)} or -")
    return Layout(device, int(workers) if workers.isdigit() else workers, int(decode) if decode.isdigit() else decode,
                  dtype, None if jpeg == "-" else jpeg)


def _check(ok: bool, spec: str, what: str) -> None:
    if not ok:
        raise ValueError(f"layout {spec!r}: {what}")


def default_decode_threads(workers: int, cores: int) -> int:
    """The server's default (settings.decode_threads_per_worker): max(2, cores // workers)."""
    return max(2, cores // workers)


def resolve(layout: Layout, rows: list[dict[str, Any]], cores: int) -> Layout:
    """``best`` workers and ``Nx`` decode threads made numbers, from the rows measured so far."""
    workers = layout.workers
    if workers == "best":
        measured = [r for r in rows if r.get("device") == layout.device and r.get("images_per_s")]
        if not measured:
            raise Skip(f"no {layout.device} layout measured to take the best of")
        workers = max(measured, key=lambda r: r["images_per_s"])["workers"]
    decode = layout.decode
    if isinstance(decode, str):
        decode = min(64, int(decode[:-1]) * default_decode_threads(int(workers), cores))
    return dataclasses.replace(layout, workers=int(workers), decode=decode)


def default_layouts(cores: int) -> list[Layout]:
    cpu = [w for w in (cores, cores // 4, cores // 2, cores // 8) if w >= 1]
    specs = ["cuda:4", "cuda:8", "cuda:1", "cuda:best:2x", "cuda:best:0:auto:pillow", f"bare:{cores}x1",
             f"bare:1x{cores}", *(f"cpu:{w}" for w in dict.fromkeys(cpu)), "cpu:best:0:float32"]
    return [parse_layout(s) for s in specs]


def server_estimate_s(layout: Layout, warm_s: float, load_s: float) -> float:
    """Start (~20 s for resnet50 with random weights, more with more workers) + load + stop."""
    return 22 + warm_s + load_s + 0.5 * (layout.workers if isinstance(layout.workers, int) else 4)



@dataclass(frozen=True)
class Step:
    phase: str  # "1 model": steps of one phase are consecutive
    name: str
    estimate_s: float  # it starts only while at least this much of the budget is left
    fn: Callable[[], object] = lambda: None


class Budget:
    """Seconds since the run started, against ``total_s``; ``clock`` is injectable for tests."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s, self.clock = total_s, clock
        self.started = clock()

    def used(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return self.total_s - self.used()


def plan_rows(steps: Sequence[Step], budget_s: float, setup_s: float) -> list[dict[str, Any]]:
    """The plan at the estimates: when each step would end, or that it only runs if earlier ones are quicker
    (the same rule as ``run_steps``: a step that does not fit is passed over, later smaller ones may fit)."""
    t = setup_s
    rows: list[dict[str, Any]] = [{"phase": "0 setup", "step": "machine, album, weights, CPU reference",
                                   "estimate_s": round(setup_s), "ends_at_s": round(setup_s), "fits": True}]
    for s in steps:
        fits = t + s.estimate_s <= budget_s
        t += s.estimate_s if fits else 0
        rows.append({"phase": s.phase, "step": s.name, "estimate_s": round(s.estimate_s),
                     "ends_at_s": round(t) if fits else None, "fits": fits})
    return rows


def plan_table(plan: list[dict[str, Any]], budget_s: float, setup_s: float) -> str:
    fitting = sum(r["estimate_s"] for r in plan if r["fits"])
    rows = [{**r, "fits": "yes" if r["fits"] else "if time", "ends_at_s": r["ends_at_s"] or "-"} for r in plan]
    return (f"## Plan: {budget_s:.0f} s budget, {fitting:.0f} s of steps fit at their estimates "
            f"(setup ~{setup_s:.0f} s)\n" + table(rows, [(c, c) for c in ("phase", "step", "estimate_s", "ends_at_s", "fits")]))


def _short(text: str, limit: int = 1500) -> str:
    return text if len(text) <= limit else text[:300] + " [...] " + text[-(limit - 300):]


def run_steps(steps: Sequence[Step], budget: Budget, log: list[dict[str, Any]], *,
              on_phase_end: Callable[[str, float], None] | None = None,
              skip: tuple[type[BaseException], ...] = ()) -> None:
    """Run each step that fits the budget left; record every step (ok, skipped and why, error) in ``log``.
    A step raising one of ``skip`` is recorded as skipped; any other exception as an error, and the run goes on."""
    for i, step in enumerate(steps):
        rec: dict[str, Any] = {"phase": step.phase, "step": step.name, "estimate_s": round(step.estimate_s)}
        log.append(rec)
        left = budget.left()
        if left < step.estimate_s:
            rec.update(status="skipped", reason=f"budget: {left:.0f} s left, needs ~{step.estimate_s:.0f} s")
        else:
            t0 = budget.used()
            print(f"-- [{step.phase}] {step.name} (~{step.estimate_s:.0f} s; {left:.0f} s left)", flush=True)
            try:
                step.fn()
                rec["status"] = "ok"
            except skip as exc:
                rec.update(status="skipped", reason=str(exc))
            except Exception as exc:
                rec.update(status="error", error=_short(f"{type(exc).__name__}: {exc}"))
                print(f"!! {step.name}: {rec['error']}", flush=True)
            rec["seconds"] = round(budget.used() - t0, 1)
        if on_phase_end and (i + 1 == len(steps) or steps[i + 1].phase != step.phase):
            on_phase_end(step.phase, phase_seconds(log).get(step.phase, 0.0))


def phase_seconds(log: Sequence[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for rec in log:
        out[rec["phase"]] = round(out.get(rec["phase"], 0.0) + rec.get("seconds", 0.0), 1)
    return out


Column = tuple[str, "str | Callable[[dict[str, Any]], Any]"]


def _cell(row: dict[str, Any], get: str | Callable[[dict[str, Any]], Any]) -> str:
    value = get(row) if callable(get) else row.get(get)
    if value is None or value == "":
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return str(value)


def table(rows: Sequence[dict[str, Any]], cols: Sequence[Column]) -> str:
    """A Markdown table; missing values are "-"."""
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(_cell(r, g) for _, g in cols) + " |" for r in rows])


def _check_cell(row: dict[str, Any]) -> str | None:
    c = row.get("check")
    return f"{c['min_centered_cosine']:.5f} {'pass' if c['passed'] else 'FAIL'}" if c else None


MODEL_COLS: list[Column] = [("dtype", "dtype"), ("batch", "batch"), ("images/s", "images_per_s"),
                            ("ms/batch", "ms_per_batch"), ("cosine vs CPU fp32 (min)", "cosine_vs_cpu_fp32_min")]
DECODE_COLS: list[Column] = [("method", "method"), ("images", "images"), ("images/s", "images_per_s"),
                             ("MP/s", "megapixels_per_s"), ("CPU ms/image", "cpu_ms_per_image"),
                             ("GPU peak MiB", "gpu_peak_mib")]
SERVER_COLS: list[Column] = [
    ("layout", "label"), ("dtype chosen", "dtype_chosen"), ("jpeg", "jpeg_decode"), ("images/s", "images_per_s"),
    ("served img/s", "served_images_per_s"), ("batch", "mean_batch"), ("mean s", "mean_latency_s"),
    ("healthz p50 ms", "healthz_p50_ms"), ("p99 ms", "healthz_p99_ms"), ("errors", "errors"),
    ("server CPU %", "server_cpu_pct"), ("hosts CPU %", "imagehost_cpu_pct"), ("client CPU %", "client_cpu_pct"),
    ("GPU util %", "gpu_util_pct"), ("start s", "start_s"), ("vs CPU ref (centered cos)", _check_cell)]
BARE_COLS: list[Column] = [("layout", "label"), ("images/s", "images_per_s"), ("s/batch", "seconds_per_batch")]
OOM_COLS: list[Column] = [("stage", "stage"), ("statuses", "statuses"), ("Retry-After", "retry_after"),
                          ("served img/s", "served_images_per_s"), ("mean s", "mean_latency_s"),
                          ("healthz p99 ms", "healthz_p99_ms"), ("max ms", "healthz_max_ms"),
                          ("worker MiB", "worker_mib"), ("GPU free MiB", "gpu_free_mib")]
STEP_COLS: list[Column] = [("phase", "phase"), ("step", "step"), ("est s", "estimate_s"), ("used s", "seconds"),
                           ("status", "status"), ("why", lambda r: r.get("reason") or (r.get("error") or "")[:120])]
OOM_FACTS = ("layout", "dtype_chosen", "jpeg_decode", "baseline_mib", "gpu_used_baseline_mib", "first_album_status",
             "after_one_album_mib", "hog_full_mib", "hog_mib", "hog_full_again_mib", "after_mib", "gpu_used_after_mib",
             "after_minus_baseline_mib", "after_all_200", "same_worker")


def oom_table(oom: dict[str, Any]) -> str:
    facts = ", ".join(f"{k} {oom[k]}" for k in OOM_FACTS if k in oom)
    return f"{facts}\n\n" + table(oom.get("stages", []), OOM_COLS)


def one_line(row: dict[str, Any]) -> str:
    """A result row as one progress line: its name, then its headline numbers."""
    keys = ("images_per_s", "served_images_per_s", "ms_per_batch", "cosine_vs_cpu_fp32_min", "dtype_chosen",
            "jpeg_decode", "healthz_p99_ms", "errors", "statuses", "gpu_util_pct", "seconds_per_batch")
    name = row.get("label") or row.get("method") or row.get("dtype") or "?"
    return f"{name}: " + ", ".join(f"{k} {_cell(row, k)}" for k in keys if k in row)


def goals(doc: dict[str, Any]) -> list[str]:
    out = []
    gpu = [r for r in doc.get("server", []) + doc.get("layouts", []) if r.get("device") == "cuda" and r.get("images_per_s")]
    if gpu:
        best = max(gpu, key=lambda r: r["images_per_s"])
        met = "MET" if best["images_per_s"] >= GOAL_IMAGES_PER_S else "not met"
        out.append(f"- best on the GPU: {best['images_per_s']} images/s ({best['label']}, dtype {best.get('dtype_chosen')}, "
                   f"jpeg {best.get('jpeg_decode')}) vs goal {GOAL_IMAGES_PER_S}: {met} ({BEFORE_IMAGES_PER_S} before, "
                   f"CPU decode); /healthz p99 there {best.get('healthz_p99_ms')} ms")
    oom = doc.get("oom") or {}
    if oom.get("stages"):
        under: dict[str, int] = {}
        for s in oom["stages"][:-1]:
            for k, v in s.get("statuses", {}).items():
                under[k] = under.get(k, 0) + v
        out.append(f"- OOM: under the hog {_cell({'x': under}, 'x')}; after it all 200: {oom.get('after_all_200')}; "
                   f"worker GPU MiB {oom.get('baseline_mib')} at baseline -> {oom.get('after_mib')} after "
                   f"({oom.get('after_minus_baseline_mib', '?')} MiB); whole GPU {oom.get('gpu_used_baseline_mib')} -> "
                   f"{oom.get('gpu_used_after_mib')} MiB")
    return out


def tables(doc: dict[str, Any], phase: str | None = None) -> str:
    """Every section present (or only ``phase``'s), then the steps and the goals."""
    titled = {"model_level": ("Model level (cuda:0, no server)", MODEL_COLS), "decode": ("JPEG decode alone", DECODE_COLS),
              "server": ("Server: pillow vs device decode", SERVER_COLS), "layouts": ("Layouts", SERVER_COLS),
              "bare": ("Bare pipeline (CPU, no server: the yardstick)", BARE_COLS)}
    sections = PHASE_SECTIONS.get(phase, ()) if phase else tuple(s for ss in PHASE_SECTIONS.values() for s in ss)
    parts = []
    for s in sections:
        if s == "oom" and doc.get("oom"):
            parts.append("## GPU out of memory\n" + oom_table(doc["oom"]))
        elif s in titled and doc.get(s):
            parts.append(f"## {titled[s][0]}\n" + table(doc[s], titled[s][1]))
    if phase is None:
        per_phase = ", ".join(f"{p} {s:.0f} s" for p, s in phase_seconds(doc.get("steps", [])).items())
        parts.append(f"## Steps (setup {doc.get('setup_s', '-')} s; {per_phase})\n" + table(doc.get("steps", []), STEP_COLS))
        parts.append("## Goals\n" + ("\n".join(goals(doc)) or "- nothing measured"))
    return "\n\n".join(parts)
