"""The worker's scheduling rules: pure decisions over one read-only ``WorkerView``.

Each function takes a snapshot of the worker and returns a decision; none reads a clock, a queue or a
setting of its own, and none changes anything. ``scheduler.Scheduler`` builds the view and carries the
decisions out. The rule table, with each rule's setting and test, is the package's docstring; the reasons
and the figures behind each rule are in docs/SCHEDULING.md, under the rule's key.
"""

from __future__ import annotations

from service.engine.scheduling.view import (
    BACKFILL,
    FIRST,
    GATHER_GAP_S,
    GATHER_MAX_S,
    GATHER_SHARE_IMAGES,
    GATHER_STOP_MARGIN,
    INTERACTIVE,
    RECENT_CALLER_S,
    TEXTS_PER_SLOT,
    BatchPlan,
    CallerView,
    DecodeTurn,
    Forming,
    Rank,
    RequestView,
    Run,
    Verdict,
    Waiting,
    WorkerView,
)

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


def lane(urgency: int) -> int:
    """backfill: a request less urgent than HTTP's default (RFC 9218 ``Priority: u=4`` to ``u=7``; u=3 when
    it says nothing) is a backfill: its images go behind every interactive one."""
    return BACKFILL if urgency > 3 else INTERACTIVE


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
    """overtaken: another request's image is due no later than the batch's last (an interactive one before any
    backfill's): it leads the next batch."""
    if own is None or not view.queue:
        return False
    head, last = min(view.queue), forming.members[-1]
    return head.request != own and (head.lane, head.tag) <= (last.lane, last.tag)


def batch_cap(view: WorkerView) -> int:
    """quantum: while callers share the worker, a forward that cannot be interrupted holds about a quantum."""
    if view.preemptible or sharing(view) < 2:
        return view.limits.max_batch
    return min(view.limits.max_batch, max(1, int(view.limits.quantum_s / max(view.seconds_per_image, 1e-6))))


def gather_until(view: WorkerView, forming: Forming, leader: RequestView | None) -> float:
    """gather: how long a batch waits for more images. Not at all with none on their way; max_wait for
    another caller's; for its own request's, while decode runs or across short gaps: on every core, as long as
    they come; on a share, until it holds ``share_stop``'s images, and its caller's other requests' count as its own."""
    until = forming.started + view.limits.max_wait_s
    if view.upstream <= 0:
        return view.now
    if not view.all_cores and forming.members and len(forming.members) >= share_stop(view, forming.members[0].model):
        return until
    if leader is None or not (leader.upstream > 0 or _callers_decoding(view, leader)):
        return until
    bound = max(until, forming.started + GATHER_MAX_S)
    gap_from = view.now if view.decoding else gap_start(view)
    return min(max(until, gap_from + GATHER_GAP_S), bound)


def share_stop(view: WorkerView, model: str) -> int:
    """gather on a share: where ``model``'s forward stops getting cheaper per image, as its precision trial timed
    it (the smallest batch within GATHER_STOP_MARGIN of the cheapest; ViT-B/32 32, resnet50 8 on AMX);
    GATHER_SHARE_IMAGES for a model not timed (a pinned GREENSERVE_DTYPE, float32 with nothing to try)."""
    costs = view.image_costs.get(model)
    if not costs:
        return GATHER_SHARE_IMAGES
    cheapest = min(costs.values())
    return min(size for size, ms in costs.items() if ms <= cheapest * (1 + GATHER_STOP_MARGIN))


def _callers_decoding(view: WorkerView, leader: RequestView) -> bool:
    """On a share, a caller's concurrent one-image requests (immich's backfill) are one album split up: their
    images decoding now are worth a batch of a size that costs less per image (docs/SCHEDULING.md#gather)."""
    return not view.all_cores and view.callers.get(leader.caller, CallerView()).decoding > 0


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
