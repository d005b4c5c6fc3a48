"""Towers out of memory and back: a tower's tensors dropped and mapped again from one file per host, and the
residency that decides when (pinned, lazy, an idle TTL), on real greenlets and a real loader thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import gevent
import pytest
import torch
from gevent.threadpool import ThreadPool
from torch import nn

from harness.polling import quiet, until
from service.engine import residency
from service.engine.model_set import LAZY, PINNED, TTL, Residency
from service.engine.residency import Tower, Towers
from service.engine.towers import TowerFile
from service.engine.towers import unload as unload_tower
from service.errors import Overloaded


def rss() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize(("text", "parsed"), [("pinned", Residency(PINNED)), ("lazy", Residency(LAZY)),
                                              ("ttl:600", Residency(TTL, 600)), ("ttl:10m", Residency(TTL, 600)),
                                              ("TTL:1.5h", Residency(TTL, 5400))])
def test_a_residency_reads_as_written(text: str, parsed: Residency) -> None:
    assert Residency.parse(text) == parsed
    with pytest.raises(ValueError, match="pinned, lazy or ttl"):
        Residency.parse("forever")


def test_a_tower_unloads_its_memory_and_maps_the_same_tensors_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.LayerNorm(4096), nn.Linear(4096, 8))  # ~33 MB
    x = torch.randn(3, 2048)
    with torch.inference_mode():
        before = model(x)
    weight = model[0].weight
    file = TowerFile(model, (), tmp_path / "tower.safetensors")
    loaded = rss()
    freed = unload_tower(file)  # as the loader thread does: the tensors dropped, the heap's free pages given back
    after_unload = rss()
    assert freed > 30_000_000 and file.nbytes() == 0
    assert model[0].weight.numel() == 0 and (tmp_path / "tower.safetensors").exists()
    assert loaded - after_unload > 25_000_000, f"RSS fell by {loaded - after_unload} bytes only"
    file.load()
    with torch.inference_mode():
        assert torch.equal(model(x), before)
    assert model[0].weight is weight, "the same Parameter objects: hooks and casts stay"
    assert file.unload() > 30_000_000  # a second unload does not write the file again
    file.load()


def test_a_channels_last_tower_comes_back_channels_last_and_a_file_of_other_shapes_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 16, 1)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        before = model(x)
    strides = [p.stride() for p in model.parameters()]
    file = TowerFile(model, (), tmp_path / "conv.safetensors")
    unload_tower(file)
    file.load()
    assert [p.stride() for p in model.parameters()] == strides, "the weights' memory layout as it was"
    with torch.inference_mode():
        assert torch.equal(model(x), before)
    other = TowerFile(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1)), (), tmp_path / "conv.safetensors")
    with pytest.raises(RuntimeError, match="remove the file and restart"):
        other.load()


def towers(events: list[str], *, kind: str = TTL, ttl_s: float = 0.0, load_gate: threading.Event | None = None,
           fail: bool = False) -> tuple[Towers, Tower]:
    def load() -> None:
        if load_gate is not None:
            load_gate.wait()
        if fail:
            raise RuntimeError("the file is gone")
        events.append("load")

    def unload() -> int:
        events.append("unload")
        return 1

    pool = ThreadPool(1)
    all_towers = Towers(pool)
    tower = Tower("clip", "image", Residency(kind, ttl_s), load, unload, load_s=0.5)
    all_towers.add(tower)
    return all_towers, tower


def test_a_lazy_tower_unloads_at_start_and_a_request_waits_for_its_load() -> None:
    events: list[str] = []
    all_towers, tower = towers(events, kind=LAZY)
    until(lambda: events == ["unload"], what="the lazy tower unloaded at start")
    all_towers.ensure("clip", ("image",), time.monotonic() + 5)
    assert events == ["unload", "load"] and all_towers.state("clip", "image") == "resident"


def test_an_idle_ttl_tower_unloads_but_never_while_a_request_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(residency, "REAP_EVERY_S", (0.01, 0.05))
    events: list[str] = []
    all_towers, tower = towers(events, ttl_s=0.05)
    with all_towers.using("clip", ("image",)):
        gevent.wait(timeout=0.3)  # several sweeps past its TTL while it is held
        assert events == []
    until(lambda: events == ["unload"], what="unloaded once idle past its TTL")
    all_towers.ensure("clip", ("image",), time.monotonic() + 5)
    assert events == ["unload", "load"]
    all_towers.stop()


def test_a_request_past_its_deadline_or_a_failed_load_is_503_not_ready() -> None:
    events: list[str] = []
    gate = threading.Event()
    all_towers, tower = towers(events, kind=LAZY, load_gate=gate)
    until(lambda: events == ["unload"])
    with pytest.raises(Overloaded) as late:
        all_towers.ensure("clip", ("image",), time.monotonic() + 0.05)
    assert late.value.code == "not_ready" and late.value.headers["Retry-After"] == "1"
    gate.set()
    until(lambda: all_towers.state("clip", "image") == "resident")
    failing, _ = towers([], kind=LAZY, fail=True)
    quiet()
    with pytest.raises(Overloaded, match="failed to load"):
        failing.ensure("clip", ("image",), time.monotonic() + 5)


def test_past_the_cap_the_least_recently_used_tower_not_pinned_is_unloaded_first() -> None:
    events: list[str] = []
    all_towers = Towers(ThreadPool(1), max_resident=2)

    def tower(model: str, kind: str) -> Tower:
        return Tower(model, "image", Residency(kind, 600), lambda: events.append(f"load {model}"),
                     lambda: events.append(f"unload {model}") or 1, load_s=0.5)

    pinned, older, newer = tower("pinned", PINNED), tower("older", TTL), tower("newer", TTL)
    for t in (pinned, older, newer):
        all_towers.add(t)  # the third goes past the cap: the least recently used one not pinned goes
    until(lambda: events == ["unload older"], what="older unloaded to make room")
    with all_towers.using("newer", ("image",)):
        all_towers.ensure("older", ("image",), time.monotonic() + 5)  # newer is held: nothing can go
    assert events == ["unload older", "load older"] and all_towers.state("newer", "image") == "resident"
    all_towers.ensure("older", ("image",), time.monotonic() + 5)
    all_towers.stop()
