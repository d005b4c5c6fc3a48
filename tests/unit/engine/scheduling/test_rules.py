"""The scheduling rules as decisions: a ``WorkerView`` in, a decision out, one table row per case."""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any

import pytest

from harness.batching import LIMITS
from service.engine import scheduling
from service.engine.scheduling import rules
from service.engine.scheduling.view import (
    BACKFILL,
    FIRST,
    GATHER_GAP_S,
    GATHER_MAX_S,
    GATHER_SHARE_IMAGES,
    INTERACTIVE,
    BatchPlan,
    CallerView,
    DecodeTurn,
    Forming,
    RequestView,
    Run,
    Verdict,
    Waiting,
    WorkerView,
)

NOW = 100.0


def request(key: int = 1, caller: str = "album", *, start: float = 0.0, upstream: int = 0, submitted: int = 0,
            taken: int = 0, decodes: int = 0, streamed: bool = False) -> RequestView:
    return RequestView(key, caller, start, upstream, submitted, taken, decodes, streamed)


def view(*requests: RequestView, queue: tuple[Waiting, ...] = (), callers: dict[str, CallerView] | None = None,
         **kw: Any) -> WorkerView:
    """A worker at NOW with these requests and queued images; each caller admitted what ``callers`` says, or
    1 image per request (upstream + submitted - taken, at least 1)."""
    if callers is None:
        callers = {}
        for r in requests:
            mine = callers.get(r.caller, CallerView())
            n = max(1, r.upstream + r.submitted - r.taken)
            queued = sum(1 for w in queue if w.caller == r.caller)
            callers[r.caller] = CallerView(mine.admitted + n, mine.decoding, queued)
    fields: dict[str, Any] = dict(
        now=NOW, limits=LIMITS, admitted=sum(c.admitted for c in callers.values()),
        upstream=sum(r.upstream for r in requests), requests={r.key: r for r in requests}, callers=callers,
        recent={}, queue=queue, decoding=0, decode_free=2, spare_busy=False, all_cores=True, urgent=False,
        last_arrival=NOW, urgent_ended=0.0, seconds_per_image=0.05, preemptible=True, texts_coming=0)
    fields.update(kw)
    return WorkerView(**fields)


def limits(**kw: Any) -> Any:
    return dataclasses.replace(LIMITS, **kw)


def waiting(tag: float, req: RequestView, seq: int = 0) -> Waiting:
    return Waiting(INTERACTIVE, tag, seq, req.key, req.caller)


ALBUM = request(1, "album", upstream=20, submitted=10)
SEARCH = request(2, "search", start=3.0, submitted=1)


@pytest.mark.parametrize(("ready", "admitted", "mine", "n", "max_queue", "share", "verdict"), [
    (False, 0, 0, 1, 64, 64, Verdict.NOT_READY),
    (True, 0, 0, 1, 64, 64, Verdict.ADMIT),
    (True, 60, 0, 4, 64, 64, Verdict.ADMIT),  # fits exactly
    (True, 60, 0, 5, 64, 64, Verdict.QUEUE_FULL),
    (True, 0, 0, 500, 64, 64, Verdict.ADMIT),  # alone, bigger than the bound: it could never run otherwise
    (True, 8, 8, 1, 64, 8, Verdict.OVER_SHARE),
    (True, 8, 0, 8, 64, 8, Verdict.ADMIT),  # another caller's share
    (True, 0, 0, 30, 64, 8, Verdict.ADMIT),  # alone, bigger than the share
])
def test_admission(ready: bool, admitted: int, mine: int, n: int, max_queue: int, share: int,
                   verdict: Verdict) -> None:
    v = view(callers={"me": CallerView(mine), "other": CallerView(admitted - mine)} if admitted else {},
             limits=limits(max_queue=max_queue, share=share))
    assert rules.admission(v, "me", n, ready) is verdict


@pytest.mark.parametrize(("admitted", "light"), [(0, False), (1, True), (16, True), (17, False)])
def test_light_caller(admitted: int, light: bool) -> None:
    assert rules.light_caller(view(callers={"c": CallerView(admitted)}), "c") is light


@pytest.mark.parametrize(("earlier", "later", "may"), [
    # the earlier requests' images on their way before the later's start, against fetch_ahead (16)
    ((request(1, "a", upstream=16),), request(2, "b", start=30.0, upstream=30), True),
    ((request(1, "a", upstream=17),), request(2, "b", start=30.0, upstream=30), False),
    ((request(1, "a", upstream=10), request(3, "c", start=10.0, upstream=10)), request(2, "b", start=30.0, upstream=30),
     False),
    ((request(1, "a", upstream=30),), request(2, "b", start=5.0, upstream=30), True),  # only 5 tagged before it
    ((request(1, "a", upstream=30),), request(2, "b", start=30.0, upstream=1), True),  # a light caller: at once
    ((request(1, "a", upstream=30),), request(2, "a", start=30.0, upstream=1), False),  # not light: 31 admitted
])
def test_may_fetch(earlier: tuple[RequestView, ...], later: RequestView, may: bool) -> None:
    v = view(*earlier, later)
    assert rules.may_fetch(v, later.key) is may


@pytest.mark.parametrize(("mine", "free", "spare_busy", "turn"), [
    (CallerView(1, 0, 0), 0, False, DecodeTurn(FIRST, spare=True)),  # its first image, threads busy: the spare
    (CallerView(1, 0, 0), 1, False, DecodeTurn(FIRST, spare=False)),  # a free thread: no spare needed
    (CallerView(1, 0, 0), 0, True, DecodeTurn(FIRST, spare=False)),  # the spare is taken: it waits, first
    (CallerView(5, 1, 0), 0, False, DecodeTurn((3.0 + 4, 4), spare=False)),  # one of its own decoding
    (CallerView(5, 0, 2), 0, False, DecodeTurn((3.0 + 4, 4), spare=False)),  # two of its own queued
])
def test_decode_turn(mine: CallerView, free: int, spare_busy: bool, turn: DecodeTurn) -> None:
    r = request(2, "search", start=3.0)
    v = view(r, callers={"search": mine}, decode_free=free, spare_busy=spare_busy)
    assert rules.decode_turn(v, r, 4) == turn
    assert rules.decode_turn(v, None, 4) == DecodeTurn(FIRST, spare=False)  # unranked work


@pytest.mark.parametrize(("queued_tags", "rank", "urgent", "may"), [
    ((0.0, 1.0), (2.0, 2), False, False),  # two earlier images queued, two decode threads
    ((0.0,), (2.0, 2), False, True),
    ((0.0, 1.0), (1.0, 1), False, True),  # only one tagged before it
    ((5.0, 6.0), (2.0, 2), False, True),  # later images do not hold it
    ((), (2.0, 2), True, False),  # an urgent forward runs
    ((0.0, 1.0, 2.0), FIRST, True, True),  # a caller's first image never waits
])
def test_may_decode(queued_tags: tuple[float, ...], rank: tuple[float, int], urgent: bool, may: bool) -> None:
    queue = tuple(waiting(t, ALBUM, i) for i, t in enumerate(queued_tags))
    assert rules.may_decode(view(ALBUM, queue=queue, urgent=urgent), rank) is may


def test_may_decode_is_monotonic_in_rank() -> None:
    """``RankedSlots`` stops at the first waiter held back: every later rank must be held back too."""
    queue = tuple(waiting(t, ALBUM, i) for i, t in enumerate((0.0, 1.0, 4.0)))
    for urgent in (False, True):
        v = view(ALBUM, queue=queue, urgent=urgent)
        answers = [rules.may_decode(v, rank) for rank in sorted([FIRST, *((t / 2, 0) for t in range(12))])]
        assert answers == sorted(answers, reverse=True), answers


@pytest.mark.parametrize(("streamed", "decodes", "all_cores", "hold"), [
    (True, 0, True, True),
    (True, 1, True, False),  # not its first decode
    (False, 0, True, False),
    (True, 0, False, False),  # a share of the cores: nothing is held
])
def test_first_decode(streamed: bool, decodes: int, all_cores: bool, hold: bool) -> None:
    r = request(streamed=streamed, decodes=decodes)
    assert rules.first_decode(view(r, all_cores=all_cores), r) is hold
    assert rules.first_decode(view(r), None) is False


@pytest.mark.parametrize(("all_cores", "hold"), [(True, True), (False, False)])
def test_holds(all_cores: bool, hold: bool) -> None:
    assert rules.holds(view(all_cores=all_cores)) is hold


@pytest.mark.parametrize(("upstream", "across", "own"), [
    (3, True, 1),  # images on their way: a batch of its own
    (0, True, None),  # all here: batches mix
    (0, False, 1),  # GREENSERVE_BATCH_ACROSS_REQUESTS=false: always its own
])
def test_members(upstream: int, across: bool, own: int | None) -> None:
    leader = request(1, upstream=upstream)
    assert rules.members(view(leader, limits=limits(across_requests=across)), leader) == own


@pytest.mark.parametrize(("head_tag", "head_is_other", "last_tag", "own", "overtaken"), [
    (2.0, True, 3.0, 1, True),  # another request's image due before its next
    (3.0, True, 3.0, 1, True),  # tagged the same
    (4.0, True, 3.0, 1, False),
    (2.0, False, 3.0, 1, False),  # its own
    (2.0, True, 3.0, None, False),  # a mixed batch is never overtaken
])
def test_overtaken(head_tag: float, head_is_other: bool, last_tag: float, own: int | None,
                   overtaken: bool) -> None:
    head = waiting(head_tag, SEARCH if head_is_other else ALBUM, 9)
    forming = Forming(NOW, (waiting(last_tag, ALBUM),))
    assert rules.overtaken(view(ALBUM, SEARCH, queue=(head,)), forming, own) is overtaken


STARTED = NOW - 0.01  # the batch began 10 ms ago; max_wait is 5 ms


@pytest.mark.parametrize(("upstream", "leader_upstream", "all_cores", "decoding", "last_arrival", "until"), [
    (0, 0, True, 0, NOW, NOW),  # nothing on its way: go now
    (5, 0, True, 0, NOW, STARTED + 0.005),  # another request's images on their way: max_wait
    (5, 5, False, 0, NOW - 0.01, NOW - 0.01 + GATHER_GAP_S),  # a share of the cores gathers as well
    (5, 5, False, 1, NOW - 1.0, NOW + GATHER_GAP_S),
    (5, 5, True, 0, NOW - 0.01, NOW - 0.01 + GATHER_GAP_S),  # decode idle: across the gap from the last arrival
    (5, 5, True, 1, NOW - 1.0, NOW + GATHER_GAP_S),  # decode busy: another gap from now
    (5, 5, True, 1, NOW, STARTED + GATHER_MAX_S),  # capped at GATHER_MAX_S from the start
])
def test_gather_until(upstream: int, leader_upstream: int, all_cores: bool, decoding: int, last_arrival: float,
                      until: float) -> None:
    leader = request(1, upstream=leader_upstream)
    other = request(2, "b", upstream=upstream - leader_upstream)
    now = STARTED + GATHER_MAX_S - 0.01 if until == STARTED + GATHER_MAX_S else NOW
    v = view(leader, other, all_cores=all_cores, decoding=decoding, last_arrival=last_arrival, now=now)
    assert rules.gather_until(v, Forming(STARTED, (waiting(0.0, leader),)), leader) == pytest.approx(until)


@pytest.mark.parametrize(("all_cores", "held", "until"), [
    (False, GATHER_SHARE_IMAGES - 1, NOW + GATHER_GAP_S),  # a share: gathering up to GATHER_SHARE_IMAGES
    (False, GATHER_SHARE_IMAGES, STARTED + 0.005),  # then max_wait (already past: it goes)
    (True, GATHER_SHARE_IMAGES * 4, NOW + GATHER_GAP_S),  # every core: as long as they come
])
def test_gather_on_a_share_stops_at_a_batch_worth_running(all_cores: bool, held: int, until: float) -> None:
    leader = request(1, upstream=5)
    v = view(leader, all_cores=all_cores, decoding=1, last_arrival=NOW, now=NOW)
    forming = Forming(STARTED, tuple(waiting(float(i), leader) for i in range(held)))
    assert rules.gather_until(v, forming, leader) == pytest.approx(until)


VIT = {1: 41.0, 8: 14.0, 32: 13.0}  # ms an image by batch size, as a trial timed ViT-B/32 on one AMX core
RESNET50 = {1: 33.0, 8: 29.0, 32: 32.0}  # torch, cast once: cheapest at 8


@pytest.mark.parametrize(("costs", "stop"), [
    ({}, GATHER_SHARE_IMAGES),  # untimed (a pinned dtype): the fixed stop
    (VIT, 32),  # 14 at 8 is 8% over 13 at 32: worth gathering on
    (RESNET50, 8),  # dearer per image past 8
    ({1: 11.0, 8: 9.0, 32: 8.8}, 8),  # within the margin of the cheapest: the smaller batch goes sooner
    ({1: 5.0, 8: 5.1, 32: 5.2}, 1),  # batching buys nothing: no gathering on a share
])
def test_share_stop_is_where_the_forward_stops_getting_cheaper_per_image(costs: dict[int, float], stop: int) -> None:
    assert rules.share_stop(view(image_costs={"m": costs}), "m") == stop
    assert rules.share_stop(view(image_costs={"m": costs}), "another model") == GATHER_SHARE_IMAGES


@pytest.mark.parametrize(("costs", "held", "until"), [
    (VIT, 31, NOW + GATHER_GAP_S),  # a ViT gathers on past 8
    (VIT, 32, STARTED + 0.005),
    (RESNET50, 8, STARTED + 0.005),  # resnet50 goes at 8
])
def test_gather_on_a_share_stops_at_the_models_own_stop(costs: dict[int, float], held: int, until: float) -> None:
    leader = dataclasses.replace(request(1, upstream=40), model="m")
    v = view(leader, all_cores=False, decoding=1, last_arrival=NOW, now=NOW, image_costs={"m": costs},
             limits=limits(max_batch=32))
    forming = Forming(STARTED, tuple(Waiting(INTERACTIVE, float(i), 0, 1, "album", "m") for i in range(held)))
    assert rules.gather_until(v, forming, leader) == pytest.approx(until)


@pytest.mark.parametrize(("caller", "all_cores", "until"), [
    ("backfill", False, NOW + GATHER_GAP_S),  # its caller's other one-photo requests decoding: gathered, a share
    ("other", False, STARTED + 0.005),  # another caller's: max_wait (a light caller never waits on an album)
    ("backfill", True, STARTED + 0.005),  # every core: max_wait (a batch of any size runs well there)
])
def test_a_callers_concurrent_one_photo_requests_gather_like_one_album(caller: str, all_cores: bool,
                                                                       until: float) -> None:
    leader = request(1, "backfill", submitted=1)
    coming = request(2, caller, upstream=1)
    v = view(leader, coming, all_cores=all_cores, decoding=1, last_arrival=NOW - 1.0,
             callers={"backfill": CallerView(2, decoding=1 if caller == "backfill" else 0, queued=1),
                      "other": CallerView(1, decoding=1 if caller == "other" else 0)})
    assert rules.gather_until(v, Forming(STARTED, (waiting(0.0, leader),)), leader) == pytest.approx(until)


@pytest.mark.parametrize(("last_arrival", "urgent_ended", "start"), [(5.0, 3.0, 5.0), (5.0, 7.0, 7.0)])
def test_gap_start(last_arrival: float, urgent_ended: float, start: float) -> None:
    assert rules.gap_start(view(last_arrival=last_arrival, urgent_ended=urgent_ended)) == start


@pytest.mark.parametrize(("callers", "recent", "preemptible", "seconds_per_image", "cap"), [
    ({"a": CallerView(30)}, {}, False, 0.05, 8),  # one caller: max_batch
    ({"a": CallerView(30), "b": CallerView(1)}, {}, False, 0.05, 5),  # 250 ms of 50 ms images
    ({"a": CallerView(30), "b": CallerView(1)}, {}, False, 0.4, 1),  # at least one
    ({"a": CallerView(30), "b": CallerView(1)}, {}, False, 0.001, 8),  # never above max_batch
    ({"a": CallerView(30)}, {"b": NOW - 0.5}, False, 0.05, 5),  # b was here half a second ago
    ({"a": CallerView(30)}, {"b": NOW - 2.0}, False, 0.05, 8),  # long gone
    ({"a": CallerView(30), "b": CallerView(1)}, {}, True, 0.05, 8),  # interruptible forwards need no cap
])
def test_batch_cap(callers: dict[str, CallerView], recent: dict[str, float], preemptible: bool,
                   seconds_per_image: float, cap: int) -> None:
    v = view(callers=callers, recent=recent, preemptible=preemptible, seconds_per_image=seconds_per_image)
    assert rules.batch_cap(v) == cap


OTHER = request(3, "other", start=4.0, submitted=3)


@pytest.mark.parametrize(("running", "queued", "left", "interject", "preemptible", "due"), [
    ((0.0, 1.0), (("search", 7.0), ("other", 5.0)), 8, True, True, (("other", 5.0), ("search", 7.0))),
    ((0.0, 1.0), (("search", 7.0), ("other", 5.0)), 1, True, True, (("other", 5.0),)),  # at most left
    ((0.0, 1.0), (("album", 2.0),), 8, True, True, ()),  # its own next images wait
    ((0.0,), (("search", 7.0),), 8, True, True, ()),  # a one-image forward is short enough
    ((0.0, 1.0), (("search", 7.0),), 8, False, True, ()),  # GREENSERVE_PREEMPT_FORWARDS=false
    ((0.0, 1.0), (("search", 7.0),), 8, True, False, ()),  # no points in the model
])
def test_interjection(running: tuple[float, ...], queued: tuple[tuple[str, float], ...], left: int, interject: bool,
                      preemptible: bool, due: tuple[tuple[str, float], ...]) -> None:
    by = {"album": ALBUM, "search": SEARCH, "other": OTHER}
    queue = tuple(waiting(tag, by[c], 10 + i) for i, (c, tag) in enumerate(queued))
    v = view(ALBUM, SEARCH, OTHER, queue=queue, limits=limits(interject=interject), preemptible=preemptible)
    run = rules.interjection(v, Forming(NOW, tuple(waiting(t, ALBUM, i) for i, t in enumerate(running))), left)
    assert [(w.caller, w.tag) for w in run.members] == list(due)
    assert run.urgent is bool(due)


@pytest.mark.parametrize(("leader_upstream", "other", "age", "interject", "runs"), [
    (5, request(2, "search", start=9.0, submitted=1), 0.1, True, True),  # a complete light request
    (0, request(2, "search", start=9.0, submitted=1), 0.1, True, False),  # the batch is not gathering
    (5, request(2, "search", start=9.0, upstream=1, submitted=1), 0.1, True, False),  # not all here
    (5, request(2, "big", start=9.0, submitted=20), 0.1, True, False),  # a complete album is not light
    (5, request(2, "search", start=9.0, submitted=1), GATHER_MAX_S, True, False),  # gathered long enough
    (5, request(2, "search", start=9.0, submitted=1), 0.1, False, False),  # GREENSERVE_PREEMPT_FORWARDS=false
])
def test_others_now(leader_upstream: int, other: RequestView, age: float, interject: bool, runs: bool) -> None:
    leader = request(1, upstream=leader_upstream)
    queued = tuple(waiting(9.0 + i, other, 20 + i) for i in range(other.submitted))
    v = view(leader, other, queue=queued, limits=limits(interject=interject))
    forming = Forming(NOW - age, (waiting(0.0, leader),))
    assert rules.others_now(v, forming, leader) == (queued if runs else ())


@pytest.mark.parametrize(("streamed", "taken", "members", "cap"), [
    (True, 1, 1, 1),  # its first image was just taken: the first row goes with at most this many
    (True, 2, 1, None),  # an earlier forward had one of its images
    (False, 1, 1, None),
])
def test_first_row(streamed: bool, taken: int, members: int, cap: int | None) -> None:
    leader = request(1, upstream=5, taken=taken, streamed=streamed)
    forming = Forming(NOW, tuple(waiting(float(i), leader, i) for i in range(members)))
    plan = rules.first_row(view(leader), forming, leader)
    assert plan == (None if cap is None else BatchPlan(cap=cap, own=1, wait_until=NOW, urgent=True))


def test_batch_plan_puts_the_first_row_before_others_and_others_before_gathering() -> None:
    streamed = request(1, upstream=5, taken=1, streamed=True)
    search = request(2, "search", start=9.0, submitted=1)
    queue = (waiting(9.0, search, 5),)
    forming = Forming(NOW, (waiting(0.0, streamed),))
    assert rules.batch_plan(view(streamed, search, queue=queue), forming) == rules.first_row(view(streamed), forming,
                                                                                            streamed)
    album = dataclasses.replace(streamed, streamed=False)
    plan = rules.batch_plan(view(album, search, queue=queue), Forming(NOW, (waiting(0.0, album),)))
    assert plan.others == Run(queue, urgent=True) and plan.wait_until == NOW
    plan = rules.batch_plan(view(album, search), Forming(NOW, (waiting(0.0, album),)))
    assert plan == BatchPlan(8, 1, NOW - 0.0 + GATHER_GAP_S)  # gathering its own images


@pytest.mark.parametrize(("n", "slots"), [(1, 1), (8, 1), (9, 2), (256, 32)])
def test_text(n: int, slots: int) -> None:
    assert rules.text_slots(n) == slots
    forming = Forming(NOW - 0.001, (Waiting(INTERACTIVE, 0.0, 0, 1, "c"),))
    assert rules.text_plan(view(texts_coming=0), forming) == BatchPlan(64, None, NOW, interject=True)  # at once,
    # and between the blocks of a running image forward: a search is interactive
    assert not rules.text_plan(view(limits=limits(interject=False)), forming).interject
    assert rules.text_plan(view(texts_coming=3), forming).wait_until == pytest.approx(NOW - 0.001 + 0.005)


def test_every_rule_in_the_table_names_a_function_and_a_test_that_exist() -> None:
    doc = scheduling.__doc__ or ""
    named = re.findall(r"\b(rules|order|admission)\.([A-Za-z_.]+)", doc)
    tests = re.findall(r"\b(test_\w+)::(test_\w+)", doc)
    assert len(named) >= 19 and len(tests) >= 19
    for module, attr in named:
        target: Any = importlib.import_module(f"service.engine.scheduling.{module}")
        for part in attr.rstrip(".").split("."):
            target = getattr(target, part)
        assert callable(target), f"{module}.{attr}"
    for module, test in tests:
        assert hasattr(importlib.import_module(f"tests.unit.engine.scheduling.{module}"), test), f"{module}::{test}"


@pytest.mark.parametrize(("urgency", "lane"), [(0, INTERACTIVE), (3, INTERACTIVE), (4, BACKFILL), (7, BACKFILL)])
def test_lane(urgency: int, lane: int) -> None:
    assert rules.lane(urgency) == lane


def test_a_backfill_batch_is_overtaken_by_any_interactive_image() -> None:
    """Waiting orders by lane first: a backfill image tagged first still goes after an interactive one."""
    backfill = Waiting(BACKFILL, 0.0, 0, 1, "album")
    search = Waiting(INTERACTIVE, 50.0, 1, 2, "search")
    assert min((backfill, search)) == search
    v = view(request(1, upstream=5), request(2, "search", start=50.0), queue=(search,))
    assert rules.overtaken(v, Forming(NOW, (backfill,)), own=1)
