"""Who is in the worker: each admitted request's place (``Admission``), each caller's fair tags and
admitted images (``Callers``).

A caller is what ``http.context.caller_of`` says (a token digest, X-Client-ID, an address): an opaque string
here, kept while its work is admitted, and for ``rules.RECENT_CALLER_S`` after in ``Callers.seen``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

from service.engine.scheduling.rules import RequestView

_keys = itertools.count(1)


class Admission:
    """One admitted request's place: its fair start tag, its caller, how many of its images are still on
    their way (being fetched or decoded), how far they got, and whether it ended early."""

    __slots__ = ("key", "arrived", "start", "caller", "upstream", "cancelled", "streamed", "submitted", "taken",
                 "decodes", "_settled")

    def __init__(self, upstream: int, arrived: float, start: float = 0.0, caller: str = "", *,
                 streamed: bool = False, settled: Callable[[int], None] | None = None) -> None:
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
                           self.decodes, self.streamed)


class FairTags:
    """Start-time fair queueing over images. A request of ``n`` images from ``caller`` starts at
    max(now, the caller's last finish) and its image i is tagged start + i; "now" is the tag of the image
    the batcher took last. A caller's requests so follow each other, and callers interleave one image each.
    Only callers with a finish ahead of now are remembered."""

    def __init__(self) -> None:
        self.now = 0.0
        self._finish: dict[str, float] = {}

    def start(self, caller: str, n: int) -> float:
        begin = max(self.now, self._finish.get(caller, 0.0))
        self._finish[caller] = begin + max(n, 1)
        return begin

    def taken(self, tag: float) -> None:
        if tag > self.now:
            self.now = tag
            if len(self._finish) > 64:  # forget callers whose work is all behind now
                self._finish = {c: f for c, f in self._finish.items() if f > tag}


class Callers:
    """The worker's callers: their fair tags, their admitted images, and when each was last admitted."""

    def __init__(self) -> None:
        self.tags = FairTags()
        self.admitted: dict[str, int] = {}  # admitted images per caller
        self.seen: dict[str, float] = {}  # when each recent caller was last admitted

    def admit(self, caller: str, n_images: int, now: float, recent_s: float) -> float:
        """Count the request's images for ``caller``; its fair start tag."""
        self.admitted[caller] = self.admitted.get(caller, 0) + n_images
        self.seen[caller] = now
        if len(self.seen) > 64:
            self.seen = {c: t for c, t in self.seen.items() if now - t < recent_s}
        return self.tags.start(caller, n_images)

    def release(self, caller: str, n_images: int) -> None:
        left = self.admitted.pop(caller) - n_images
        if left:
            self.admitted[caller] = left
