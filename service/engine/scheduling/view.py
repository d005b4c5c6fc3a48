"""What the scheduling rules read and decide: one read-only ``WorkerView`` of the worker, and the decisions'
shapes (``BatchPlan``, ``DecodeTurn``, ``Run``, ``Verdict``). Values only: ``rules`` decides, ``scheduler.Scheduler``
builds the views.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

Rank = tuple[float, int]  # (an image's fair tag, its index in the request): lower goes first
FIRST: Rank = (float("-inf"), 0)  # unranked work (a big JSON body, a text) and a caller's first image

GATHER_GAP_S = 0.05  # with decode idle, a gathering batch goes once no image has arrived for this long
GATHER_MAX_S = 2.0  # a gathering batch goes after this long whatever comes (a bound, not a tuning)
GATHER_SHARE_IMAGES = 8  # on a share of the cores, an untimed model's batch of this many stops gathering
GATHER_STOP_MARGIN = 0.05  # a timed model's stops at the smallest size within this of its cheapest per image
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


INTERACTIVE, BACKFILL = 0, 1  # lanes: a backfill's images go behind every interactive one


class Waiting(NamedTuple):
    """An image waiting for the model; tuples order by lane, then tag, then arrival."""

    lane: int
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
    # per served model, its image forward's ms per image by batch size, as its precision trial timed them
    image_costs: Mapping[str, Mapping[int, float]] = field(default_factory=dict)


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
