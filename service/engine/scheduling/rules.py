"""The worker's scheduling rules: pure decisions over one read-only ``WorkerView``.

Each function takes a snapshot of the worker and returns a decision; none reads a clock, a queue or a
setting of its own, and none changes anything. ``scheduler.Scheduler`` builds the view and carries the
decisions out. The rule table, with each rule's setting and test, is the package's docstring; the reasons
and the figures behind each rule are in docs/SCHEDULING.md, under the rule's key.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

Rank = tuple[float, int]  # (an image's fair tag, its index in the request): lower goes first
FIRST: Rank = (float("-inf"), 0)  # unranked work (a big JSON body, a text) and a caller's first image

GATHER_GAP_S = 0.05  # with decode idle, a gathering batch goes once no image has arrived for this long
GATHER_MAX_S = 2.0  # a gathering batch goes after this long whatever comes (a bound, not a tuning)
RECENT_CALLER_S = 1.0  # a caller admitted this recently still shares the worker
TEXTS_PER_SLOT = 8  # a CLIP text costs about an eighth of an image's forward


@dataclass(frozen=True)
class Limits:
    """The settings the rules read, fixed for a worker's life."""

    max_queue: int  # GREENSERVE_MAX_QUEUE_IMAGES
    share: int  # GREENSERVE_MAX_CALLER_IMAGES (the whole queue when unset)
    fetch_ahead: int  # GREENSERVE_FETCH_CONCURRENCY: also the size of a light caller's work
    decode_threads: int
    max_batch: int
    max_text_batch: int
    max_wait_s: float  # GREENSERVE_MAX_BATCH_WAIT_MS
    quantum_s: float  # GREENSERVE_FAIR_QUANTUM_MS
    across_requests: bool  # GREENSERVE_BATCH_ACROSS_REQUESTS
    interject: bool  # GREENSERVE_PREEMPT_FORWARDS


@dataclass(frozen=True)
class RequestView:
    """One admitted request."""

    key: int
    caller: str
    start: float  # its fair start tag: image i is tagged start + i
    upstream: int  # images still being fetched or decoded
    submitted: int  # images that reached the batcher's queue
    taken: int  # images that left the queue for a forward
    decodes: int  # images that asked for a decode thread
    streamed: bool  # its answer is streamed, one line per image
    model: str = ""  # the served model it asked for

    def upstream_before(self, tag: float) -> int:
        """Of its images on their way, about how many are tagged before ``tag`` (they arrive roughly in order)."""
        return max(0, min(self.upstream, int(tag - (self.start + self.submitted))))


@dataclass(frozen=True)
class CallerView:
    """One caller's work in the worker."""

    admitted: int = 0  # images admitted (queued, on their way or running)
    decoding: int = 0  # images decoding or waiting for a decode thread
    queued: int = 0  # images waiting for the model


class Waiting(NamedTuple):
    """An image waiting for the model; tuples order by tag, then by arrival."""

    tag: float
    seq: int
    request: int  # its RequestView's key
    caller: str
    model: str = ""  # the model it goes through: a forward holds one model's images


@dataclass(frozen=True)
class Forming:
    """A batch being formed (or running): when it began, and its images so far, the leader first."""

    started: float
    members: tuple[Waiting, ...]


@dataclass(frozen=True)
class WorkerView:
    """The worker, as the rules see it at one moment."""

    now: float
    limits: Limits
    admitted: int  # images admitted (queued or running)
    upstream: int  # admitted images still being fetched or decoded
    requests: Mapping[int, RequestView]
    callers: Mapping[str, CallerView]
    recent: Mapping[str, float]  # when each recent caller was last admitted
    queue: tuple[Waiting, ...]  # the images waiting for the model, in no order
    decoding: int  # images decoding or waiting to
    decode_free: int  # decode threads no one holds
    spare_busy: bool  # the spare decode thread (``decode_turn``) is taken
    all_cores: bool  # the next forward runs on every core (``cores.CorePlan``)
    urgent: bool  # an urgent forward runs now
    last_arrival: float  # when an image last reached the queue
    urgent_ended: float  # when the last urgent forward ended
    seconds_per_image: float  # the batcher's measured forward time per image
    preemptible: bool  # the model has points where a running forward can be interrupted
    texts_coming: int = 0  # texts being tokenised


class Verdict(enum.Enum):
    ADMIT = "admit"
    NOT_READY = "not_ready"  # 503
    QUEUE_FULL = "overloaded"  # 503
    OVER_SHARE = "over_share"  # 429


@dataclass(frozen=True)
class DecodeTurn:
    rank: Rank  # its place among the decode threads' waiters
    spare: bool  # it takes the spare decode thread instead of waiting


@dataclass(frozen=True)
class Run:
    """Images to forward on their own now, and whether that forward is urgent."""

    members: tuple[Waiting, ...] = ()
    urgent: bool = False


@dataclass(frozen=True)
class BatchPlan:
    """What a forming batch does next: take up to ``cap`` images of ``model`` (only request ``own``'s, if set),
    waiting for more until ``wait_until``; ``closed``: take no more; ``others``: run these first, on their own."""

    cap: int
    own: int | None
    wait_until: float
    urgent: bool = False
    closed: bool = False
    others: Run = Run()
    model: str = ""
    interject: bool = False  # run between the blocks of a forward already running, rather than after it


# ---------------------------------------------------------------------------------------------- admission

def admission(view: WorkerView, caller: str, n_images: int, ready: bool) -> Verdict:
    """admit, share: 503 while the model loads or with the queue full, 429 over the caller's share. Alone, a
    request bigger than either bound is admitted: it could never run otherwise."""
    if not ready:
        return Verdict.NOT_READY
    if view.admitted and view.admitted + n_images > view.limits.max_queue:
        return Verdict.QUEUE_FULL
    mine = view.callers.get(caller, CallerView()).admitted
    if mine and mine + n_images > view.limits.share:
        return Verdict.OVER_SHARE
    return Verdict.ADMIT


def text_slots(n_texts: int) -> int:
    """text: the queue slots ``n_texts`` texts take."""
    return -(-n_texts // TEXTS_PER_SLOT)


def light_caller(view: WorkerView, caller: str) -> bool:
    """light-caller: a caller whose work here is small (a search, a one-photo call)."""
    return 0 < view.callers.get(caller, CallerView()).admitted <= view.limits.fetch_ahead


def sharing(view: WorkerView) -> int:
    """How many callers share the worker: those with work here or admitted within RECENT_CALLER_S."""
    recent = {c for c, t in view.recent.items() if view.now - t < RECENT_CALLER_S}
    return len(recent | {c for c, v in view.callers.items() if v.admitted})


# ---------------------------------------------------------------------------------------------- fetch

def may_fetch(view: WorkerView, key: int) -> bool:
    """fetch-pacing: once the earlier requests have at most ``fetch_ahead`` images on their way; a light
    caller at once."""
    request = view.requests[key]
    if light_caller(view, request.caller):
        return True
    ahead = sum(r.upstream_before(request.start) for k, r in view.requests.items() if k != key)
    return ahead <= view.limits.fetch_ahead


# ---------------------------------------------------------------------------------------------- decode

def first_image(view: WorkerView, caller: str) -> bool:
    """first-image: the caller has nothing decoding or waiting for the model."""
    mine = view.callers.get(caller)
    return mine is not None and not mine.decoding and not mine.queued


def decode_turn(view: WorkerView, request: RequestView | None, index: int) -> DecodeTurn:
    """first-image: an image's place for a decode thread. Unranked work and a caller's first image go first;
    the latter takes the spare thread rather than wait."""
    if request is None:
        return DecodeTurn(FIRST, spare=False)
    if first_image(view, request.caller):
        return DecodeTurn(FIRST, spare=not view.spare_busy and not view.decode_free)
    return DecodeTurn((request.start + index, index), spare=False)


def may_decode(view: WorkerView, rank: Rank) -> bool:
    """decode-lookahead, urgent: not while the model has ``decode_threads`` earlier images queued, nor while an
    urgent forward runs. Monotonic in ``rank``, as ``order.RankedSlots`` needs."""
    if rank == FIRST:
        return True
    if view.urgent:
        return False
    return sum(1 for w in view.queue if w.tag < rank[0]) < view.limits.decode_threads


def first_decode(view: WorkerView, request: RequestView | None) -> bool:
    """first-decode: a streamed answer's first decode holds the hub's reads."""
    return request is not None and request.streamed and not request.decodes and holds(view)


def holds(view: WorkerView) -> bool:
    """urgent: urgent work holds decodes and reads only while the forward has every core; with a share, the
    other cores are left to the rest."""
    return view.all_cores


# ---------------------------------------------------------------------------------------------- batch

def batch_plan(view: WorkerView, forming: Forming) -> BatchPlan:
    """The next step of a forming image batch."""
    leader = view.requests.get(forming.members[0].request)
    model = forming.members[0].model
    if (plan := first_row(view, forming, leader)) is not None:
        return plan
    cap = batch_cap(view)
    own = members(view, leader)
    if others := others_now(view, forming, leader):
        return BatchPlan(cap, own, view.now, others=Run(others, urgent=holds(view)), model=model)
    return BatchPlan(cap, own, gather_until(view, forming, leader), closed=overtaken(view, forming, own), model=model)


def first_row(view: WorkerView, forming: Forming, leader: RequestView | None) -> BatchPlan | None:
    """first-row: a streamed answer's first row goes at once, alone, urgent."""
    if leader is None or not leader.streamed:
        return None
    mine = sum(1 for m in forming.members if m.request == leader.key)
    if leader.taken > mine:  # an earlier forward had its images: this is not its first row
        return None
    return BatchPlan(cap=1, own=leader.key, wait_until=view.now, urgent=holds(view), model=leader.model)


def members(view: WorkerView, leader: RequestView | None) -> int | None:
    """own-batch: a batch led by a request with images on their way holds only that request's images."""
    if leader is None or (view.limits.across_requests and leader.upstream <= 0):
        return None
    return leader.key


def overtaken(view: WorkerView, forming: Forming, own: int | None) -> bool:
    """overtaken: another request's image is due no later than the batch's last: it leads the next batch."""
    if own is None or not view.queue:
        return False
    head = min(view.queue)
    return head.request != own and head.tag <= forming.members[-1].tag


def batch_cap(view: WorkerView) -> int:
    """quantum: while callers share the worker, a forward that cannot be interrupted holds about a quantum."""
    if view.preemptible or sharing(view) < 2:
        return view.limits.max_batch
    return min(view.limits.max_batch, max(1, int(view.limits.quantum_s / max(view.seconds_per_image, 1e-6))))


def gather_until(view: WorkerView, forming: Forming, leader: RequestView | None) -> float:
    """gather: how long a batch waits for more images. Not at all with none on their way; max_wait for
    another request's; on every core, for its own request's, while decode runs or across short gaps."""
    until = forming.started + view.limits.max_wait_s
    if view.upstream <= 0:
        return view.now
    if leader is None or leader.upstream <= 0 or not view.all_cores:
        return until
    bound = max(until, forming.started + GATHER_MAX_S)
    gap_from = view.now if view.decoding else gap_start(view)
    return min(max(until, gap_from + GATHER_GAP_S), bound)


def gap_start(view: WorkerView) -> float:
    """gap-clock: the silence is timed from the last arrival, or from the end of the last urgent forward
    (reads and decodes were held, so nothing could arrive)."""
    return max(view.last_arrival, view.urgent_ended)


def others_now(view: WorkerView, forming: Forming, leader: RequestView | None) -> tuple[Waiting, ...]:
    """others-while-gathering: while a batch waits for its request's images, light callers' complete
    requests run (until GATHER_MAX_S); the model is idle meanwhile."""
    if not view.limits.interject or leader is None or leader.upstream <= 0 \
            or view.now >= forming.started + GATHER_MAX_S:
        return ()
    inside = {m.caller for m in forming.members}
    due = sorted(w for w in view.queue if w.caller not in inside and light_caller(view, w.caller)
                 and _complete(view, w.request))
    return _one_model(due)[:batch_cap(view)]


def interjection(view: WorkerView, running: Forming, left: int) -> Run:
    """interject: other callers' images run between the blocks of a running forward, at most ``left`` (as many
    as it holds); a caller's own next images wait for it."""
    if not view.limits.interject or not view.preemptible or len(running.members) < 2 or left <= 0:
        return Run()
    inside = {m.caller for m in running.members}
    due = _one_model(sorted(w for w in view.queue if w.caller not in inside))[:left]
    return Run(due, urgent=holds(view)) if due else Run()


def text_plan(view: WorkerView, forming: Forming) -> BatchPlan:
    """text: a text batch holds texts only and waits (max_wait) only while texts are being tokenised; it is
    interactive work (a search): it runs between the blocks of a running image forward, not after it."""
    until = forming.started + view.limits.max_wait_s if view.texts_coming > 0 else view.now
    return BatchPlan(view.limits.max_text_batch, None, until, model=forming.members[0].model,
                     interject=view.limits.interject)


def _one_model(due: list[Waiting]) -> tuple[Waiting, ...]:
    """A forward holds one model's images: the first due image's model."""
    return tuple(w for w in due if w.model == due[0].model) if due else ()


def _complete(view: WorkerView, key: int) -> bool:
    request = view.requests.get(key)
    return request is not None and request.upstream <= 0
