"""Who is in the worker: each admitted request's place (``Admission``), each caller's fair tags and
admitted images (``Callers``).

A caller is what ``http.context.caller_of`` says (a token digest, X-Client-ID, an address): an opaque string
here. What is kept of callers is bounded: a fair finish tag and a count only while a caller has work
admitted, and the last ``RECENT_KEPT`` callers' admission times (``rules.sharing`` only asks whether two or
more callers were here within ``rules.RECENT_CALLER_S``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

from service.engine.scheduling.view import RequestView

_keys = itertools.count(1)
RECENT_KEPT = 64


class Admission:
    """One admitted request's place: its fair start tag, its caller, how many of its images are still on
    their way (being fetched or decoded), how far they got, and whether it ended early."""

    __slots__ = ("key", "arrived", "start", "caller", "upstream", "cancelled", "streamed", "submitted", "taken",
                 "decodes", "model", "lane", "_settled")

    def __init__(self, upstream: int, arrived: float, start: float = 0.0, caller: str = "", *,
                 streamed: bool = False, model: str = "", lane: int = 0,
                 settled: Callable[[int], None] | None = None) -> None:
        self.key = next(_keys)
        self.arrived = arrived
        self.start = start
        self.caller = caller
        self.upstream = upstream
        self.cancelled = False
        self.streamed = streamed  # its answer is streamed, one line per image
        self.submitted = 0  # images that reached the batcher
        self.taken = 0  # images that left the queue for a forward
        self.decodes = 0  # images that asked for a decode thread
        self.model = model  # the served model it asked for
        self.lane = lane  # rules.INTERACTIVE, or rules.BACKFILL (it said so: Priority u > 3)
        self._settled = settled

    @contextlib.contextmanager
    def image(self) -> Iterator[None]:
        """One image's way to the batcher: on leaving, it reached the batcher or failed, once."""
        try:
            yield
        finally:
            self.upstream -= 1
            if self._settled is not None:
                self._settled(1)

    def rank(self, index: int) -> tuple[float, int]:
        """Image ``index``'s place for a decode slot."""
        return (self.start + index, index)

    def next_tag(self) -> float:
        """The tag of the request's next image to reach the batcher (in the order they come)."""
        self.submitted += 1
        return self.start + self.submitted - 1

    def view(self) -> RequestView:
        return RequestView(self.key, self.caller, self.start, self.upstream, self.submitted, self.taken,
                           self.decodes, self.streamed, self.model)


class FairTags:
    """Start-time fair queueing over images. A request of ``n`` images from ``caller`` starts at
    max(now, the caller's last finish) and its image i is tagged start + i; "now" is the tag of the image
    the batcher took last. A caller's requests so follow each other, and callers interleave one image each.
    A caller is forgotten when it has no work left (``forget``): its images were all taken, so its finish
    was at most one image ahead of now, and it starts at now again."""

    def __init__(self) -> None:
        self.now = 0.0
        self._finish: dict[str, float] = {}

    def start(self, caller: str, n: int) -> float:
        begin = max(self.now, self._finish.get(caller, 0.0))
        self._finish[caller] = begin + max(n, 1)
        return begin

    def taken(self, tag: float) -> None:
        self.now = max(self.now, tag)

    def forget(self, caller: str) -> None:
        self._finish.pop(caller, None)

    def __len__(self) -> int:
        return len(self._finish)


class Callers:
    """The worker's callers: their fair tags, their admitted images, and when each was last admitted."""

    def __init__(self) -> None:
        self.tags = FairTags()
        self.admitted: dict[str, int] = {}  # admitted images per caller
        self.seen: dict[str, float] = {}  # when each recent caller was last admitted

    def admit(self, caller: str, n_images: int, now: float) -> float:
        """Count the request's images for ``caller``; its fair start tag."""
        self.admitted[caller] = self.admitted.get(caller, 0) + n_images
        self.seen.pop(caller, None)
        self.seen[caller] = now  # the most recent last
        if len(self.seen) > RECENT_KEPT:
            del self.seen[next(iter(self.seen))]
        return self.tags.start(caller, n_images)

    def release(self, caller: str, n_images: int) -> None:
        left = self.admitted.pop(caller) - n_images
        if left:
            self.admitted[caller] = left
        else:
            self.tags.forget(caller)

    def tracked(self) -> int:
        """Callers something is kept of (bounded by the admitted ones plus ``RECENT_KEPT``)."""
        return len(set(self.admitted) | set(self.seen) | set(self.tags._finish))
