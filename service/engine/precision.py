"""Which numerics each tower of a worker's model serves in. ``GREENSERVE_DTYPE=auto`` (the default) takes a
lower precision only where the hardware runs it natively, it gives the same answers as float32 *and* it is
faster, measured:

    hardware                                candidate    else
    CUDA, compute capability >= 8.0         bfloat16     float32
    CUDA 7.x (tensor cores, no bf16)        float16      float32
    CPU with AMX (amx_bf16) or avx512_bf16  bfloat16     float32
    any other CPU                           none         float32, no trial (bf16 would be emulated: slower)

Each tower (image, and text where there is one) tries the candidate two ways, weights cast once and
autocast (``casting.Numerics``); on a CPU the image tower also tries OpenVINO (``openvino_runtime``:
bfloat16 where native, and float32, which can beat torch's float32 on any CPU). Each against float32, warm,
at the batch sizes its batcher forms (1, a middle size, the max batch), in ascending order, on photo-like
probe crops (``PROBE_TEXTS`` for a text tower). A trial is kept only if every output has cosine >=
``MIN_COSINE`` to float32's, every image the same top-1 class, and its time over the sizes is ``MIN_SPEEDUP``
x float32's or better; of the kept ones the first in ``_ways``' order serves unless another is more than
``TIE_MARGIN`` x as fast (``preferred``: a tie within noise is broken the same way everywhere), else float32.
A trial stops early once it can no longer be fast enough (``_hopeless``).
A pinned value (float32, bfloat16, float16) is served as given, weights cast once, untried. Runs in the
worker's inference thread, before warm-up.

A trial's outcome is kept under everything it depends on (``precision_records``): in the server's ``Memo``,
so a worker that replaces another after a HUP or a respawn serves what was measured at the server's start,
on idle cores, instead of timing again on cores that serve a reload's load (two workers timed under that load
chose differently: docs/SCHEDULING.md#hand-over); and with a Redis cache in the fleet's record, so every
instance serves the numerics the first one measured, and finds the others' cache entries.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.engine import precision_records as records
from service.engine.casting import BY_NAME, FLOAT32, OPENVINO_BFLOAT16, OPENVINO_FLOAT32, OPENVINO_INT8, Numerics, dtype_name
from service.engine.model import LoadedModel
from service.engine.precision_records import REUSED, FleetStore, Memo
from service.engine.probes import PROBE_TEXTS, probe_pixels
from service.engine.types import MIN_COSINE, MIN_SPEEDUP, TIE_MARGIN, Precision, TowerChoice, Trial

log = logging.getLogger(__name__)

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

# (tower, numerics, batch size, run the forward) -> (its outputs, seconds); tests inject the seconds
Timer = Callable[[str, Numerics, int, Callable[[], Any]], tuple[Any, float]]
TRIAL_TURN_S = 120.0  # the longest a worker waits for a sibling's trial before it times its own
TEXT_ON_TORCH = ("; other runtimes not tried: only image towers convert (torch runs a text batch at its longest text's "
                 "length; docs/history/runtimes.md)")


def wall_clock(tower: str, numerics: Numerics, size: int, run: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = run()
    return out, time.perf_counter() - started


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The sizes a batcher with ``max_batch`` forms that a trial times: 1, a quarter, the max."""
    return tuple(sorted({1, max(1, max_batch // 4), max_batch}))


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def candidate_for(device: torch.device, cpu_bf16: str = "auto",
                  flags: frozenset[str] | None = None) -> tuple[torch.dtype | None, str]:
    """The lower precision this hardware runs natively (None: float32 only), and the hardware in words.

    ``cpu_bf16`` (``GREENSERVE_CPU_BF16``) overrides the CPU check: ``yes`` where the flags are hidden
    (some VMs), ``no`` to keep float32."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        hardware = f"cuda sm_{major}{minor} {torch.cuda.get_device_name(device)}"
        if major >= 8:
            return torch.bfloat16, hardware
        return (torch.float16 if major == 7 else None), hardware
    flags = cpu_flags() if flags is None else flags
    native = [f for f in CPU_BF16_FLAGS if f in flags]
    simd = next((f for f in ("avx512f", "avx2", "neon", "asimd") if f in flags), "baseline")
    hardware = f"cpu {' '.join(native) or simd}"
    if cpu_bf16 == "yes" or cpu_bf16 == "auto" and native:
        return torch.bfloat16, hardware + (" (GREENSERVE_CPU_BF16=yes)" if cpu_bf16 == "yes" else "")
    return None, hardware + (" (GREENSERVE_CPU_BF16=no)" if cpu_bf16 == "no" else "")


def settle(model: LoadedModel, requested: str, *, cpu_bf16: str = "auto", flags: frozenset[str] | None = None,
           image_sizes: tuple[int, ...] = (1, 8, 32), text_sizes: tuple[int, ...] = (1, 16, 64),
           timer: Timer = wall_clock, memo: Memo | None = None, fleet: FleetStore | None = None,
           runtimes: tuple[str, ...] = (), int8_min_cosine: float | None = None) -> Precision:
    """Set each of ``model``'s towers' numerics from ``requested`` (``GREENSERVE_DTYPE``); log and record why.
    ``image_sizes``/``text_sizes``: the batch sizes to time (``batch_sizes`` of the batchers' maxima);
    ``memo``: where an earlier worker's trial is read from, and this one's kept; ``fleet``: the fleet's record,
    adopted where there is one, else this trial's offered to it (``precision_records``); ``runtimes``: the
    other runtimes the image tower may be converted to (``model.compiler``'s, with its version), tried too;
    ``int8_min_cosine``: int8 is tried as well, kept at that agreement (GREENSERVE_INT8)."""
    candidate, hardware = candidate_for(model.device, cpu_bf16, flags)
    by = ""
    ways = {tower: _ways(model, tower, candidate, bool(runtimes), int8_min_cosine) for tower in model.towers}
    if requested != "auto":
        pinned = Numerics(getattr(torch, requested), cast=requested != "float32")
        choices = [_serve(model, tower, pinned, "pinned by GREENSERVE_DTYPE") for tower in model.towers]
        reason, source = "pinned by GREENSERVE_DTYPE", "pinned"
    elif not any(ways.values()):
        reason = f"{hardware}: no native bfloat16 or float16 (it would be emulated, slower than float32), so float32"
        choices = [_serve(model, tower, FLOAT32, reason) for tower in model.towers]
        source = "hardware"
    else:
        sizes = {"image": image_sizes, "text": text_sizes}
        key = records.trial_key(model, requested, cpu_bf16, hardware, sizes, runtimes)
        choices, source, by = _trial(model, key, ways, sizes, timer, memo, fleet)
        choices = [replace(c, reason=c.reason + TEXT_ON_TORCH) if runtimes and c.tower == "text" else c for c in choices]
        reason = f"{hardware}: " + "; ".join(f"{c.tower} tower {c.reason}" for c in choices)
    model.release_float32()
    precision = Precision(requested, dtype_name(model.dtype), hardware, reason, tuple(choices), source, by)
    model.info = replace(model.info, dtype=precision.chosen, precision=precision)
    log.info("serving in %s (GREENSERVE_DTYPE=%s): %s", ", ".join(f"{c.tower} {c.numerics}" for c in choices),
             requested, _summary(precision))
    log.debug("precision: %s", reason)
    return precision


# where a timed choice came from, in the start-up line
_SOURCES = {"measured": "measured here", "server": "as this server measured it", "fleet": "as the fleet measured it"}


def _summary(precision: Precision) -> str:
    """The start-up line's why: the whole reason when it is short (pinned, or no native low precision); for a
    timed choice, the hardware, where it came from and each tower's speed-up. Every trial's timings (some 800
    characters) are in /v1/models and the debug log."""
    if precision.source not in _SOURCES:
        return precision.reason
    faster = ", ".join(f"{c.tower} {t.speedup:.2f}x float32" for c in precision.towers for t in c.trials
                       if t.numerics == c.numerics)
    return (f"{precision.hardware}, {_SOURCES[precision.source]}{f' ({faster})' if faster else ''}; every trial: "
            "/v1/models precision")


def _ways(model: LoadedModel, tower: str, candidate: torch.dtype | None, convert: bool,
          int8: float | None) -> tuple[tuple[Numerics, float], ...]:
    """What ``tower`` tries against float32, each with the agreement it must keep, in the order that breaks ties
    (``preferred``): the candidate cast once, then autocast; then, for a CPU's image tower, converted to OpenVINO
    in the candidate, then float32 (which can beat torch's float32 without any rounding), then int8 where the
    operator allows it (at the cosine ``int8`` they stated)."""
    ways = (Numerics(candidate, cast=True), Numerics(candidate, cast=False)) if candidate is not None else ()
    if convert and tower == "image" and model.device.type == "cpu":
        ways += (*((OPENVINO_BFLOAT16,) if candidate == torch.bfloat16 else ()), OPENVINO_FLOAT32)
        if int8 is not None:
            return (*((way, MIN_COSINE) for way in ways), (OPENVINO_INT8, int8))
    return tuple((way, MIN_COSINE) for way in ways)


def _trial(model: LoadedModel, key: str, ways: dict[str, tuple[tuple[Numerics, float], ...]], sizes: dict[str, tuple[int, ...]],
           timer: Timer, memo: Memo | None, fleet: FleetStore | None) -> tuple[list[TowerChoice], str, str]:
    """The towers' choices under ``key``, where this worker got them (server, fleet, measured) and who timed
    them: an earlier worker's (the memo), else the fleet's record, else timed here and offered to the fleet,
    whose first record wins (two instances that measured at once serve one choice)."""
    # one worker at a time: at the first start the second one reads what the first measured (two
    # trials at once share the cores, time each other, and may choose differently)
    with memo.exclusive(TRIAL_TURN_S) if memo is not None else contextlib.nullcontext():
        kept = records.decode(key, memo.get(key)) if memo is not None else None
        if kept is not None:
            return _apply(model, kept, REUSED), "server", kept.by
        kept, answered = records.read_fleet(fleet, key)
        source = "fleet"
        if kept is None:
            choices = [_choose(model, tower, ways[tower], sizes[tower], timer) for tower in model.towers]
            ours = records.Record.of(choices, records.this_process())
            kept = records.offer(fleet, key, ours) if fleet is not None and answered else ours
            source = "measured" if kept is ours else "fleet"
        if source == "fleet":
            assert fleet is not None
            choices = _apply(model, kept, records.ADOPTED.format(where=fleet.where, by=kept.by))
        if memo is not None:
            memo.put(key, records.Record.of(choices, kept.by).encode(key))
    return choices, source, kept.by


def _apply(model: LoadedModel, record: records.Record, prefix: str) -> list[TowerChoice]:
    """``record``'s choices served by ``model``, each reason after ``prefix`` (where it was read)."""
    return [_serve(model, tower, BY_NAME[numerics], prefix + reason, sizes, ms=ms)
            for tower, numerics, reason, sizes, ms in record.towers]


def _serve(model: LoadedModel, tower: str, numerics: Numerics, reason: str, sizes: tuple[int, ...] = (),
           trials: Sequence[Trial] = (), ms: tuple[float, ...] = ()) -> TowerChoice:
    """``tower`` serves in ``numerics``; ``ms``: its times at ``sizes``, else its trial's."""
    model.set_numerics(tower, numerics)
    timed = next((t.ms for t in trials if t.numerics == numerics.name and t.sizes == sizes), ())
    return TowerChoice(tower, numerics.name, reason, sizes, tuple(trials), ms or timed)


def _choose(model: LoadedModel, tower: str, bounded: tuple[tuple[Numerics, float], ...], sizes: tuple[int, ...],
            timer: Timer) -> TowerChoice:
    ways = tuple(way for way, _ in bounded)
    if not ways:
        return _serve(model, tower, FLOAT32, "float32: nothing else to try (no native lower precision, and no "
                      "other runtime for this tower)")
    inputs = _probe_inputs(model, tower, max(sizes))
    reference = _timed_sizes(model, tower, FLOAT32, inputs, sizes, timer)
    if reference.error is not None:
        raise RuntimeError(f"the {tower} tower fails in float32: {reference.error}")
    trials = [_compare(way, _timed_sizes(model, tower, way, inputs, sizes, timer, reference), reference, bound)
              for way, bound in bounded]
    best = preferred(trials, sizes)
    if best is None:
        return _serve(model, tower, FLOAT32, "float32: " + "; ".join(_refusal(t) for t in trials), sizes, trials,
                      tuple(reference.ms))
    reason = "; ".join([f"{ways[best].name}: {trials[best].text()}"] +
                       [_refusal(t, trials[best]) for i, t in enumerate(trials) if i != best])
    return _serve(model, tower, ways[best], reason, sizes, trials)


def preferred(trials: Sequence[Trial], sizes: tuple[int, ...]) -> int | None:
    """Which trial serves (None: float32): of those kept, the first in their fixed order (``_ways``) unless
    another is more than ``TIE_MARGIN`` x as fast. Not simply the fastest: two instances that time two ways
    alike within noise must choose alike, or their cache keys and vectors differ (issue 40)."""
    kept = [i for i, t in enumerate(trials) if t.kept(sizes)]
    if not kept:
        return None
    fastest = max(trials[i].speedup for i in kept)
    return next(i for i in kept if trials[i].speedup * TIE_MARGIN >= fastest)


def _refusal(trial: Trial, chosen: Trial | None = None) -> str:
    if trial.error is not None:
        return trial.text()
    if not trial.agrees:
        return f"{trial.text()}: disagreed with float32"
    if trial.speedup < MIN_SPEEDUP:
        return f"{trial.text()}: agreed but {'slower' if trial.speedup < 1 else 'not enough faster'}"
    if chosen is not None and trial.speedup > chosen.speedup:
        return f"{trial.text()}: kept, faster by less than {TIE_MARGIN}x: a tie, and {chosen.numerics} goes first"
    return f"{trial.text()}: kept, slower than the one chosen"


@dataclass
class _Run:
    sizes: list[int]
    ms: list[float]
    outputs: list[tuple[Any, Any]]  # (features or text embeddings, logits) per size
    error: str | None = None


def _timed_sizes(model: LoadedModel, tower: str, numerics: Numerics, inputs: np.ndarray, sizes: tuple[int, ...],
                 timer: Timer, reference: _Run | None = None) -> _Run:
    """``tower`` in ``numerics``: one untimed call (weight casts, first allocations), then each size once,
    ascending. Against a ``reference`` (float32's run) it stops before a size once it cannot reach
    ``MIN_SPEEDUP`` even if it ran the remaining sizes twice as fast, relative to float32, as it did so far."""
    run = _Run([], [], [])
    try:
        model.set_numerics(tower, numerics)
        forward = _forward_of(model, tower)
        forward(inputs[:1])
        for i, size in enumerate(sizes):
            if reference is not None and i and _hopeless(run.ms, reference.ms):
                break
            out, seconds = timer(tower, numerics, size, functools.partial(forward, inputs[:size]))
            run.sizes.append(size)
            run.ms.append(seconds * 1000)
            run.outputs.append(out)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:  # an op without this dtype
        log.warning("%s tower in %s failed: %s", tower, numerics.name, exc)
        run.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return run


def _hopeless(ms: list[float], ms_float32: list[float]) -> bool:
    spent, done = sum(ms), len(ms)
    ratio = sum(ms_float32[:done]) / spent if spent > 0 else float("inf")
    best_case = spent + sum(ms_float32[done:]) / (2 * ratio)
    return best_case > sum(ms_float32) / MIN_SPEEDUP


def _forward_of(model: LoadedModel, tower: str) -> Callable[[np.ndarray], tuple[Any, Any]]:
    if tower == "text":
        return lambda ids: (model.encode_text(ids), None)
    return model.forward


def _compare(numerics: Numerics, run: _Run, reference: _Run, bound: float = MIN_COSINE) -> Trial:
    ms32 = tuple(reference.ms[:len(run.ms)])
    if run.error is not None:
        return Trial(numerics.name, tuple(run.sizes), tuple(run.ms), ms32, None, None, 0, run.error, bound)
    cosines, same, compared, with_logits = [], 0, 0, False
    for (low, logits_low), (f32, logits32) in zip(run.outputs, reference.outputs, strict=False):  # run may have stopped early
        a, b = (f32, low) if f32 is not None else (logits32, logits_low)
        cosines.append(_min_cosine(a, b))
        compared += int(a.shape[0])
        if logits32 is not None and logits_low is not None:
            with_logits = True
            same += int((logits32.argmax(dim=1) == logits_low.argmax(dim=1)).sum())
    return Trial(numerics.name, tuple(run.sizes), tuple(run.ms), ms32, min(cosines) if cosines else None,
                 same if with_logits else None, compared, min_cosine_bound=bound)


def _probe_inputs(model: LoadedModel, tower: str, n: int) -> np.ndarray:
    """``n`` probe inputs for ``tower``: the probe crops (or texts' token ids) repeated."""
    if tower == "text":
        base = model.tokenize(PROBE_TEXTS).ids
    else:
        base = probe_pixels(model.info.transform.crop_size)
    return base[np.arange(n) % len(base)]


def _min_cosine(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).min())
