"""Sharing a worker between callers: each image's fair tag, each caller's share of the queue, and how
long a forward may be while callers share.

A caller is what ``http.context.caller_of`` says (a token digest, X-Client-ID, an address): an opaque
string here, kept only while its work is admitted or for RECENT_CALLER_S after.
"""

from __future__ import annotations

import time

from service import metrics
from service.errors import OverShare
from service.settings import Settings

RECENT_CALLER_S = 1.0  # a caller admitted this recently still counts as sharing the worker


class FairTags:
    """Start-time fair queueing over images. A request of ``n`` images from ``caller`` starts at
    max(now, the caller's last finish) and its image i is tagged start + i; "now" is the tag of the image
    the batcher took last. A caller's requests so follow each other, and callers interleave one image each.
    Only callers with a finish ahead of now are remembered: the map is bounded by the admitted requests."""

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
    """The worker's callers: their fair tags, their admitted images (GREENSERVE_MAX_CALLER_IMAGES), and
    who shares the worker now."""

    def __init__(self, settings: Settings) -> None:
        self._share = settings.caller_share()
        self._quantum_s = settings.fair_quantum_ms / 1000
        self._tags = FairTags()
        self._admitted: dict[str, int] = {}  # admitted images per caller
        self._seen: dict[str, float] = {}  # when each recent caller was last admitted

    def admit(self, caller: str, n_images: int, seconds_per_image: float) -> float:
        """The request's fair start tag, or 429 when the caller would go over its share. Alone, a request
        bigger than the share is admitted: it could never run otherwise."""
        mine = self._admitted.get(caller, 0)
        if mine and mine + n_images > self._share:
            metrics.OVER_SHARE.inc()
            wait = mine * seconds_per_image
            raise OverShare(f"this caller has {mine} image(s) queued or running on this worker (its share: "
                            f"{self._share}); retry after ~{wait:.1f}s or send fewer images at a time",
                            retry_after_s=wait)
        self._admitted[caller] = mine + n_images
        now = time.monotonic()
        self._seen[caller] = now
        if len(self._seen) > 64:
            self._seen = {c: t for c, t in self._seen.items() if now - t < RECENT_CALLER_S}
        return self._tags.start(caller, n_images)

    def release(self, caller: str, n_images: int) -> None:
        left = self._admitted.pop(caller) - n_images
        if left:
            self._admitted[caller] = left

    def taken(self, tag: float) -> None:
        self._tags.taken(tag)

    def batch_cap(self, seconds_per_image: float) -> int | None:
        """While more than one caller has work here (or had, within RECENT_CALLER_S), a forward holds
        about GREENSERVE_FAIR_QUANTUM_MS of images (at the batcher's measured ``seconds_per_image``): another
        caller's next image then waits for one short forward, not for a gathered 30-image one (4 s for CLIP
        on 2 cores). One caller: no cap."""
        now = time.monotonic()
        active = set(self._admitted) | {c for c, t in self._seen.items() if now - t < RECENT_CALLER_S}
        if len(active) < 2:
            return None
        return max(1, int(self._quantum_s / max(seconds_per_image, 1e-6)))
