"""bench.gpu_check without a GPU: the budget planner, the layouts, the tables and goals from a made-up results
document, the nvidia-smi / Prometheus parsers and the load summary; the command's --help and its refusal without
CUDA; the image hosts on one port; the GPU memory hog on a fake torch; and short CPU-only runs on a real server."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from bench import album, gpu_check, gpu_parts
from bench.gpu_check import Budget, Layout, Step, plan_rows, run_steps
from bench.gpu_parts import parse_metric, summarise
from harness.launch import ROOT
from harness.load import Done, error_code
from harness.stats import percentile


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _step(clock: FakeClock, phase: str, name: str, estimate: float, takes: float, ran: list[str],
          exc: BaseException | None = None) -> Step:
    def fn() -> None:
        ran.append(name)
        clock.now += takes
        if exc is not None:
            raise exc

    return Step(phase, name, estimate, fn)


# ---------------------------------------------------------------------- the budget and the plan

def test_plan_marks_steps_that_do_not_fit_and_lets_later_smaller_ones_in() -> None:
    steps = [Step("1 model", "a", 20), Step("2 server", "b", 50), Step("2 server", "c", 10)]
    rows = plan_rows(steps, budget_s=65, setup_s=30)
    assert [(r["step"], r["fits"], r["ends_at_s"]) for r in rows] == [
        ("machine, album, weights, CPU reference", "yes", 30), ("a", "yes", 50), ("b", "if time", None),
        ("c", "yes", 60)]
    text = gpu_parts.table(rows, ["phase", "step", "estimate_s", "ends_at_s", "fits"])
    assert "| 2 server | b | 50 | - | if time |" in text


def test_run_steps_skips_what_the_budget_left_cannot_hold() -> None:
    clock, ran, log = FakeClock(), list[str](), list[dict[str, Any]]()
    budget = Budget(100, clock=clock)
    clock.now += 30  # setup
    steps = [_step(clock, "1 model", "model", 20, 25, ran), _step(clock, "2 server", "pillow", 30, 40, ran),
             _step(clock, "2 server", "device", 30, 30, ran), _step(clock, "4 layouts", "tiny", 5, 4, ran)]
    run_steps(steps, budget, log)
    assert ran == ["model", "pillow", "tiny"]  # device needed 30 with 5 left; tiny fit in them
    assert [r["status"] for r in log] == ["ok", "ok", "skipped", "ok"]
    assert log[2]["reason"].startswith("budget: 5 s left")
    assert [r.get("seconds") for r in log] == [25.0, 40.0, None, 4.0]


def test_run_steps_records_errors_and_goes_on() -> None:
    clock, ran, log = FakeClock(), list[str](), list[dict[str, Any]]()
    steps = [_step(clock, "3 oom", "boom", 1, 2, ran, RuntimeError("worker exited:\n" + "x" * 5000)),
             _step(clock, "4 layouts", "fine", 1, 1, ran)]
    run_steps(steps, Budget(100, clock=clock), log)
    assert ran == ["boom", "fine"]
    assert [r["status"] for r in log] == ["error", "ok"]
    assert log[0]["error"].startswith("RuntimeError: worker exited") and len(log[0]["error"]) <= 1510
    assert log[0]["seconds"] == 2.0


def test_default_plan_fits_every_phase_in_one_device_call_on_16_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    args = gpu_check.parse_args(["--out", "/nonexistent"])
    assert args.budget_s == gpu_check.BUDGET_S <= 480 - 120  # the call's timeout, less the install and a slow start
    steps = gpu_check.Run(args, args.cores, Budget(args.budget_s), {}).steps()
    rows = plan_rows(steps, args.budget_s, gpu_check.SETUP_S)
    assert [r["phase"] for r in rows] == ["0 setup", "1 model", "2 server", "2 server", "3 oom", "4 layouts",
                                          "4 layouts"]
    assert all(r["fits"] == "yes" for r in rows) and rows[-1]["ends_at_s"] <= args.budget_s - 60  # a minute spare
    assert any("jpeg device" in r["step"] and r["phase"] == "2 server" for r in rows)
    assert rows[-1]["step"] == "cpu 16 workers, dtype auto, jpeg -"
    tight = plan_rows(steps, 240, gpu_check.SETUP_S)  # the tail of phase 4 only runs if earlier steps are quicker
    assert tight[5]["fits"] == "yes" and tight[-1]["fits"] == "if time"


# ---------------------------------------------------------------------- layouts

def test_layout_labels() -> None:
    assert Layout("cuda", 2, jpeg="device").label == "cuda 2 workers, dtype auto, jpeg device"
    assert Layout("cpu", 1, "float32").label == "cpu 1 worker, dtype float32, jpeg -"


def test_bad_phase_on_the_command_line_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--out", "x", "--phases", "model,warp"])
    assert exc.value.code == 2 and "unknown phase(s) warp" in capsys.readouterr().err


def test_default_layouts_are_four_workers_on_the_gpu_and_a_cpu_worker_per_core() -> None:
    assert gpu_check.default_layouts(16) == [Layout("cuda", 4, jpeg="device"), Layout("cpu", 16)]


# ---------------------------------------------------------------------- tables, goals, JSON

def _server_row(label: str, ips: float, **extra: Any) -> dict[str, Any]:
    return {"label": label, "device": "cuda", "workers": 2, "images_per_s": ips, "served_images_per_s": ips - 5,
            "dtype_chosen": "bfloat16", "jpeg_decode": "device", "healthz_p50_ms": 3.1, "healthz_p99_ms": 41.0,
            "failed": 0, "statuses": {"200": 40}, **extra}


def _doc() -> dict[str, Any]:
    return {
        "setup_s": 12.5,
        "model_level": [{"dtype": "float32", "images_per_s": 6900.0, "ms_per_batch": 9.3, "cosine_vs_cpu_fp32": 1.0}],
        "server": [_server_row("cuda 2 workers pillow", 280.0, jpeg_decode="pillow"),
                   _server_row("cuda 2 workers device", 1234.5,
                               check={"min_centered_cosine": 0.99991, "passed": True})],
        "oom": {"layout": "cuda 1 workers", "baseline_mib": 1500, "after_mib": 1520, "gpu_used_baseline_mib": 3000,
                "gpu_used_after_mib": 3020, "after_all_200": True, "stages": [
                    {"stage": "hog leaves ~512 MiB", "statuses": {"200": 3, "503 out_of_memory": 2},
                     "retry_after": ["1"], "healthz_p99_ms": 12.0, "worker_mib": 2100},
                    {"stage": "hog gone", "statuses": {"200": 4}, "healthz_p99_ms": 9.0, "worker_mib": 1520}]},
        "steps": [{"phase": "1 model", "step": "m", "estimate_s": 25, "seconds": 20.0, "status": "ok"},
                  {"phase": "4 layouts", "step": "cpu 2", "estimate_s": 30, "status": "skipped",
                   "reason": "budget: 3 s left"}]}


def test_tables_and_goals_from_a_results_document() -> None:
    doc = _doc()
    text = gpu_check.tables(doc)
    for title in ("Model level", "Server: pillow vs device", "GPU out of memory", "Steps (setup 12.5 s)", "Goals"):
        assert title in text, title
    assert "| cuda 2 workers device | bfloat16 | device | 1234.5 | 1229.5 |" in text
    assert "0.99991 pass" in text and "503 out_of_memory: 2" in text and "budget: 3 s left" in text
    goals = "\n".join(gpu_check.goals(doc))
    assert "1234.5 images/s (cuda 2 workers device" in goals and "vs goal 1100: MET" in goals
    assert "503 out_of_memory: 2" in goals and "1500 at baseline -> 1520 after; whole GPU 3000 -> 3020 MiB" in goals
    doc["server"][1]["images_per_s"] = 900.0
    assert "not met" in "\n".join(gpu_check.goals(doc))
    assert "Layouts" not in text and json.loads(json.dumps(doc)) == doc


def test_missing_values_are_dashes_and_nothing_measured_says_so() -> None:
    assert gpu_parts.table([{"a": 1}], ["a", "b"]).splitlines()[-1] == "| 1 | - |"
    assert gpu_check.tables({}).endswith("- nothing measured")


def test_results_are_written_after_every_row(tmp_path: Path) -> None:
    args = argparse.Namespace(out=tmp_path, phases=[], layouts=[])
    run = gpu_check.Run(args, 16, Budget(100), {"budget_s": 100})
    run.add("server", _server_row("a", 500.0))
    assert json.loads((tmp_path / "gpu.json").read_text())["server"][0]["images_per_s"] == 500.0
    assert "| a | bfloat16 | device | 500.0 |" in (tmp_path / "gpu.md").read_text()
    run.add("server", _server_row("b", 600.0))
    assert [r["label"] for r in json.loads((tmp_path / "gpu.json").read_text())["server"]] == ["a", "b"]


# ---------------------------------------------------------------------- parsers and the load summary

SMI_APPS = """12345, 1532 MiB
12346, [N/A]
12345, 100 MiB
not a line
"""
SMI_GPUS = "0, NVIDIA H200, 1234, 143771, 7, 580.95.05\n"
SMI_BANNER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_nvidia_smi_parsers() -> None:
    assert gpu_parts.parse_apps(SMI_APPS) == {12345: 1632, 12346: None}
    assert gpu_parts.parse_apps("12345, 800\n") == {12345: 800}  # nounits
    assert gpu_parts.parse_apps("") == {}
    assert gpu_parts.parse_csv(SMI_GPUS, gpu_parts.GPU_FIELDS) == [
        {"index": 0, "name": "NVIDIA H200", "memory_used_mib": 1234, "memory_total_mib": 143771,
         "utilization_pct": 7, "driver": "580.95.05"}]
    unsupported = gpu_parts.parse_csv("0, H200, [Not Supported], 10, 0, 1\n", gpu_parts.GPU_FIELDS)
    assert unsupported[0]["memory_used_mib"] is None
    assert gpu_parts.parse_cuda_version(SMI_BANNER) == "13.0" and gpu_parts.parse_cuda_version("") is None


def test_prometheus_metric_and_error_code() -> None:
    text = ('# HELP greenserve_images_total Images\ngreenserve_images_total 1234.0\n'
            'greenserve_batch_size_sum{a="1"} 10.0\ngreenserve_batch_size_sum{a="2"} 5.0\n'
            'greenserve_images_total_created 17e8\n')
    assert parse_metric(text, "greenserve_images_total") == 1234.0
    assert parse_metric(text, "greenserve_batch_size_sum") == 15.0 and parse_metric(text, "nope") == 0.0
    assert error_code({"error": {"code": "out_of_memory", "details": []}}) == "out_of_memory"
    body = {"error": {"code": "images_failed", "details": [{"code": "out_of_memory"}, {"code": "fetch_failed"}]}}
    assert error_code(body) == "images_failed/fetch_failed,out_of_memory" and error_code([]) == "?"


def test_summary_counts_only_the_window_and_drain_when_asked() -> None:
    # ending at 0.5, 1.5, 2.0, 2.5 and 3.5
    done = [Done(-0.5, 1.0, 200, 30), Done(0.5, 1.0, 200, 30),
            Done(0.0, 2.0, 503, 30, "out_of_memory", retry_after="1"), Done(1.5, 1.0, 200, 30), Done(2.5, 1.0, 200, 30)]
    probes = [(1.0 + i / 100, 0.001 * (i + 1), True) for i in range(100)] + [(1.5, 10.0, False)]
    s = summarise(done, probes, 1.0, 3.0)
    assert s["requests"] == 3 and s["ok"] == 2 and s["failed"] == 1 and s["served_images_per_s"] == 30.0
    assert s["statuses"] == {"200": 2, "503 out_of_memory": 1} and s["retry_after"] == ["1"]
    assert s["healthz_p50_ms"] == 50.0 and s["healthz_p99_ms"] == 99.0 and s["healthz_errors"] == 1
    drained = summarise(done, probes, 1.0, 3.0, count_until=4.0)
    assert drained["statuses"]["200"] == 3 and drained["served_images_per_s"] == 30.0
    assert percentile([], 0.5) is None and percentile([1.0], 0.99) == 1.0


# ---------------------------------------------------------------------- the command, processes, CPU runs

def _module(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_help_shows_the_device_command_line() -> None:
    r = _module("--help")
    assert r.returncode == 0 and "--budget-s" in r.stdout
    assert "--no-index --find-links bench/out/gpu-wheels" in r.stdout
    assert f"PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out $OUT/gpu --budget-s {gpu_check.BUDGET_S}" in r.stdout
    assert "timeout_s 480" in r.stdout


@pytest.mark.slow  # a fresh interpreter imports torch
def test_without_cuda_it_says_so_instead_of_a_traceback(tmp_path: Path) -> None:
    r = _module("--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})  # no device, even on a GPU machine
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_image_hosts_share_one_port(tmp_path: Path) -> None:
    album.ensure_album(tmp_path, count=2, max_side=64)
    with gpu_parts.ImageHosts(tmp_path, 2) as hosts:
        assert len(set(hosts.pids)) == 2
        for _ in range(6):  # fresh connections: the kernel spreads them over both
            r = requests.get(hosts.base_url + "img001.jpg", timeout=10)
            assert r.status_code == 200 and r.content == (tmp_path / "img001.jpg").read_bytes()
    assert all(c.proc.exitcode is not None for c in hosts.children)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_cpu_only_run_measures_a_server(tmp_path: Path) -> None:
    r = _module("--out", str(tmp_path), "--budget-s", "240", "--phases", "layouts", "--smoke")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert [s["status"] for s in doc["steps"]] == ["ok"], doc["steps"]
    row, = doc["layouts"]
    assert row["images_per_s"] > 0 and set(row["statuses"]) == {"200"} and row["healthz_probes"] > 10
    assert row["dtype_chosen"] == "float32" and row["server_cpu_pct"] > 0
    assert "## Layouts" in r.stdout and "## Goals" in r.stdout and doc["machine"]["cores"] >= 1


FAKE_SMI = """#!/bin/sh
case "$*" in
  *query-compute-apps*) echo "{pid}, 700 MiB" ;;
  *query-gpu*) echo "0, NVIDIA H200, 2000, 143771, 55, 580.95.05" ;;
  *) echo "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |" ;;
esac
"""


def test_gpu_sampler_and_queries_read_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(pid=os.getpid()))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_parts.apps() == {os.getpid(): 700} and gpu_parts.gpus()[0]["memory_used_mib"] == 2000
    assert gpu_parts.gpu0()["memory_free_mib"] == 143771 - 2000
    assert gpu_parts.parse_cuda_version(gpu_parts.smi()) == "13.0"
    sampler = gpu_parts.GpuSampler()
    sampler.start()
    assert sampler.stop() == {"gpu_util_pct": 55, "gpu_mem_max_mib": 2000}
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_parts.apps() == {} and gpu_parts.gpus() == [] and gpu_parts.gpu0()["memory_free_mib"] is None


class FakeHog:
    """The OOM phase's hog without a GPU: records its commands."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.stopped = 0

    def ready(self) -> None:
        self.commands.append("ready")

    def command(self, line: str) -> int:
        self.commands.append(line)
        return 1000 if line == "fill" else 500

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped += 1


@pytest.mark.e2e
@pytest.mark.slow
def test_server_run_checks_embeddings_and_the_oom_phase_runs_its_stages(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, with the hog and nvidia-smi faked: the orchestration the GPU run will go through."""
    args = gpu_check.parse_args(["--out", str(tmp_path), "--smoke"])
    run = gpu_check.Run(args, 2, Budget(240), {})
    run.setup()
    hog = FakeHog()
    monkeypatch.setattr(gpu_parts, "Hog", lambda: hog)
    monkeypatch.setattr(gpu_parts, "apps", lambda: {})
    with gpu_parts.ImageHosts(run.album_dir, 1) as hosts:
        run.base_url, run.host_pids = hosts.base_url, hosts.pids
        run.server_run(Layout("cpu", 1, "float32"), "2 server")
        row, = run.doc["server"]
        assert row["check"]["passed"] and row["dtype_chosen"] == "float32" and row["images_per_s"] > 0
        saves: list[int] = []
        monkeypatch.setattr(run, "save", lambda: saves.append(1))
        run.oom(Layout("cpu", 1, "float32"))
    out = run.doc["oom"]
    assert hog.commands == ["ready", "fill", "free 512", "fill"] and hog.stopped >= 1
    assert [s["stage"] for s in out["stages"]] == ["hog leaves ~512 MiB", "hog takes all", "hog gone"]
    assert out["after_all_200"] and out["same_worker"] and out["dtype_chosen"] == "float32"
    assert out["hog_full_mib"] == 1000 and out["hog leaves ~512 MiB: hog MiB"] == 500 and len(saves) == 3


FAKE_TORCH = '''uint8 = "uint8"
held = [0]
LIMIT = (3 << 30) + (5 << 26) + (2 << 24) + 12345  # 3 GiB + 5 x 64 MiB + 2 x 16 MiB fit, then CUDA refuses
class T:
    def __init__(self, n): self.n = n
    def numel(self): return self.n
    def __del__(self): held[0] -= self.n
def zeros(*a, **k): return T(0)
def empty(n, dtype=None, device=None):
    if held[0] + n > LIMIT: raise RuntimeError("CUDA out of memory")
    held[0] += n
    return T(n)
class cuda:
    @staticmethod
    def empty_cache(): pass
'''


@pytest.mark.slow  # allocates GBs
def test_hog_fills_in_shrinking_chunks_and_frees_about_what_it_is_told(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)  # the hog's torch: a fake GPU of ~3.4 GiB
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned child starts from this process's sys.path
    hog = gpu_parts.Hog()
    try:
        hog.ready()
        assert hog.command("fill") == 3 * 1024 + 5 * 64 + 2 * 16
        assert hog.command("free 100") == 3424 - 16 - 16 - 64 - 64  # the smallest chunks first
        assert hog.command("fill") == 3424 and hog.command("free 2000") == 1024
    finally:
        hog.stop()
    assert hog.proc.exitcode == 0
