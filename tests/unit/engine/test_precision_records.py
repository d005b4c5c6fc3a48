"""A fleet agrees on its numerics (issue 40): a tie within noise goes to cast once wherever it is timed, and with a
fleet store the first instance measures and records its choice, the others adopt it without timing, two that
measured at once serve the first record, and a store that cannot answer leaves each to measure for itself.
On a tiny model (its bfloat16 agrees with float32) with an injected clock: fast."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from service.balance.memo import SharedMemo
from service.engine import precision, precision_records
from service.engine.casting import Numerics
from service.engine.model import LoadedModel
from service.engine.types import MIN_SPEEDUP, TIE_MARGIN, ModelInfo, Transform, Trial

CPU = torch.device("cpu")
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})
SIZES = (1, 2, 4)
CAST, AUTO = "bfloat16 cast once", "bfloat16 autocast"


def tiny() -> LoadedModel:
    torch.manual_seed(0)
    info = ModelInfo("tiny", ("embeddings",), 8, (), "cpu", "float32", "random", Transform(16, 16),
                     weights_digest="d" * 64)
    return LoadedModel(info=info, module=nn.Sequential(nn.Flatten(), nn.Linear(16 * 16 * 3, 8)), device=CPU,
                       channels_last=False, features_only=True)


class Clock:
    """Runs the forward, and says it took 10 ms per image over each way's speedup (float32: 1x)."""

    def __init__(self, cast: float, autocast: float) -> None:
        self.speedups = {CAST: cast, AUTO: autocast}
        self.calls: list[str] = []

    def __call__(self, tower: str, numerics: Numerics, size: int, run: Callable[[], Any]) -> tuple[Any, float]:
        self.calls.append(numerics.name)
        return run(), size * 0.01 / self.speedups.get(numerics.name, 1.0)


class FakeFleet:
    """A fleet store in a dict, set-if-absent as Redis's SET NX. ``down``: the calls that raise ConnectionError;
    ``late``: reads find nothing, as an instance's that read before the other one wrote."""

    where = "fake redis"

    def __init__(self, down: tuple[str, ...] = (), late: bool = False) -> None:
        self.records: dict[str, bytes] = {}
        self.down, self.late = down, late
        self.calls: list[str] = []
        self.closed = False

    def get(self, key: str) -> bytes | None:
        self.calls.append("get")
        if "get" in self.down:
            raise ConnectionError("connection refused")
        return None if self.late else self.records.get(key)

    def put_first(self, key: str, value: bytes) -> bytes | None:
        self.calls.append("put")
        if "put" in self.down:
            raise ConnectionError("connection refused")
        return self.records.setdefault(key, value)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """What ``precision_records`` logged, from INFO (held on its logger: ``logs.configure`` stops propagation)."""
    logger = logging.getLogger(precision_records.__name__)
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def settle(clock: Clock, fleet: FakeFleet | None = None, memo: SharedMemo | None = None,
           model: LoadedModel | None = None) -> precision.Precision:
    return precision.settle(model or tiny(), "auto", flags=ZEN4, image_sizes=SIZES, timer=clock, fleet=fleet, memo=memo)


def trial(numerics: str, speedup: float, cosine: float = 1.0) -> Trial:
    return Trial(numerics, SIZES, (10 / speedup,) * 3, (10.0,) * 3, cosine, None, 7)


@pytest.mark.parametrize(("cast", "autocast", "serves"), [
    (trial(CAST, 1.7), trial(AUTO, 1.85), 0),  # within the margin: a tie, cast once goes first
    (trial(CAST, 1.85), trial(AUTO, 1.7), 0),
    (trial(CAST, 1.6), trial(AUTO, 1.6 * TIE_MARGIN * 0.999), 0),  # just inside the margin: still a tie
    (trial(CAST, 1.6), trial(AUTO, 1.6 * TIE_MARGIN * 1.001), 1),  # just past it
    (trial(CAST, 1.5), trial(AUTO, 1.9), 1),  # autocast faster by more than the noise
    (trial(CAST, 1.1), trial(AUTO, 1.2), 1),  # cast once not kept (under MIN_SPEEDUP): no tie to break
    (trial(CAST, 3.0, cosine=0.99), trial(AUTO, 1.3), 1),  # cast once disagrees with float32
    (trial(CAST, 1.1), trial(AUTO, 0.9), None),  # neither kept: float32
])
def test_a_tie_within_the_noise_margin_goes_to_cast_once(cast: Trial, autocast: Trial, serves: int | None) -> None:
    assert TIE_MARGIN == MIN_SPEEDUP
    assert precision.preferred([cast, autocast], SIZES) == serves


def test_two_instances_timing_alike_within_noise_serve_the_same_numerics() -> None:
    one, other = settle(Clock(cast=1.7, autocast=1.85)), settle(Clock(cast=1.85, autocast=1.7))
    assert one.towers[0].numerics == other.towers[0].numerics == CAST
    assert "a tie, and bfloat16 cast once goes first" in one.reason
    assert "kept, slower than the one chosen" in other.reason


def test_the_first_instance_measures_and_records_its_choice_for_the_fleet() -> None:
    fleet = FakeFleet()
    chosen = settle(Clock(cast=3.0, autocast=0.6), fleet)
    assert (chosen.source, chosen.measured_by) == ("measured", precision_records.this_process())
    assert chosen.towers[0].numerics == CAST and chosen.towers[0].trials
    assert fleet.calls == ["get", "put"] and len(fleet.records) == 1
    (key, blob), = fleet.records.items()
    record = precision_records.decode(key, blob)
    assert record is not None and record.towers[0][:2] == ("image", CAST)


def test_the_next_instance_adopts_the_fleets_record_without_timing(said: pytest.LogCaptureFixture) -> None:
    fleet = FakeFleet()
    first = settle(Clock(cast=3.0, autocast=0.6), fleet)
    clock, model = Clock(cast=0.5, autocast=0.4), tiny()  # it would choose float32
    again = settle(clock, fleet, model=model)
    assert clock.calls == [] and fleet.calls == ["get", "put", "get"]
    assert again.towers[0].numerics == CAST and model.module[1].weight.dtype == torch.bfloat16  # really cast
    assert (again.source, again.measured_by) == ("fleet", first.measured_by)
    assert again.towers[0].reason == f"as measured by the fleet (fake redis, by {first.measured_by}): " + \
        first.towers[0].reason
    assert "as measured by the fleet (fake redis" in said.text
    card = model.info.public()["precision"]
    assert card["source"] == "fleet" and card["towers"]["image"]["trials"] == []


def test_instances_that_measured_at_once_serve_the_first_record() -> None:
    fleet = FakeFleet()
    first = settle(Clock(cast=3.0, autocast=0.6), fleet)
    fleet.late = True  # the second read before the first wrote: it measures, and would choose autocast
    clock = Clock(cast=1.2, autocast=3.0)
    second = settle(clock, fleet)
    assert clock.calls and len(fleet.records) == 1
    assert second.towers[0].numerics == first.towers[0].numerics == CAST
    assert (second.source, second.measured_by) == ("fleet", first.measured_by)


@pytest.mark.parametrize("down", ["get", "put"])
def test_a_fleet_store_that_cannot_answer_leaves_the_instance_to_measure(down: str,
                                                                          said: pytest.LogCaptureFixture) -> None:
    fleet = FakeFleet(down=(down,))
    chosen = settle(Clock(cast=3.0, autocast=0.6), fleet)
    assert chosen.source == "measured" and chosen.towers[0].numerics == CAST
    assert fleet.calls == (["get"] if down == "get" else ["get", "put"])  # a store that did not read is not written
    assert f"could not be {'read' if down == 'get' else 'written'}" in said.text


def test_a_damaged_fleet_record_is_measured_over_and_said(said: pytest.LogCaptureFixture) -> None:
    fleet = FakeFleet()
    settle(Clock(cast=3.0, autocast=0.6), fleet)
    (key, blob), = fleet.records.items()
    fleet.records[key] = blob.replace(CAST.encode(), b"int4 magic")
    clock = Clock(cast=1.2, autocast=3.0)
    chosen = settle(clock, fleet)
    assert clock.calls and chosen.source == "measured" and chosen.towers[0].numerics == AUTO
    assert "is damaged" in said.text and "could not be read back" in said.text


def test_a_record_reads_back_only_under_its_own_key() -> None:
    record = precision_records.Record((("image", CAST, "why", SIZES, (5.0, 8.0, 14.0)),), "host pid 1")
    blob = record.encode("k")
    assert precision_records.decode("k", blob) == record
    kept_before_ms = blob.replace(b", [5.0, 8.0, 14.0]", b"")  # a record kept before the times were: read, untimed
    assert kept_before_ms != blob and precision_records.decode("k", kept_before_ms) == precision_records.Record(
        (("image", CAST, "why", SIZES, ()),), "host pid 1")
    assert precision_records.decode("other", blob) is None
    assert precision_records.decode("k", b"[not a record") is None and precision_records.decode("k", None) is None


def test_the_servers_memo_comes_first_and_keeps_the_fleets_choice() -> None:
    fleet, memo = FakeFleet(), SharedMemo()
    first = settle(Clock(cast=3.0, autocast=0.6), fleet)
    adopted = settle(Clock(cast=0.5, autocast=0.4), fleet, memo)  # this server's first worker: the fleet's
    calls = list(fleet.calls)
    clock = Clock(cast=0.5, autocast=0.4)
    sibling = settle(clock, fleet, memo)  # its next worker: the memo, without asking the fleet
    assert clock.calls == [] and fleet.calls == calls
    assert adopted.source == "fleet" and sibling.source == "server"
    assert sibling.measured_by == first.measured_by and sibling.towers[0].numerics == CAST
    # the times of what it serves come along: the sibling's gather stops where the first worker's does
    assert sibling.towers[0].ms == adopted.towers[0].ms == first.towers[0].ms == first.towers[0].trials[0].ms
    assert sibling.towers[0].reason == precision_records.REUSED + adopted.towers[0].reason


@pytest.mark.parametrize(("requested", "flags", "source"), [("float32", ZEN4, "pinned"), ("auto", AVX2, "hardware")])
def test_a_choice_made_without_a_trial_never_touches_the_fleet(requested: str, flags: frozenset[str],
                                                               source: str) -> None:
    fleet = FakeFleet()
    chosen = precision.settle(tiny(), requested, flags=flags, image_sizes=SIZES, fleet=fleet)
    assert fleet.calls == [] and chosen.source == source and chosen.measured_by == ""
