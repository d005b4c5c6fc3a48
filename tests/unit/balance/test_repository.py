"""The model repository shared by a host's workers: an unload reaches a worker that is still loading, so it
never serves the model once ready (the race CI found: a worker that became ready after the unload returned
answered 200 for up to one follow tick)."""

from __future__ import annotations

from service.balance.repository import Follower, SharedRepository


class Worker:
    """A worker's engines as the Follower sees them: ``withdrawn`` is the worker's intent, ``ready`` its load."""

    def __init__(self, ready: bool) -> None:
        self.ready, self.withdrawn, self.applied = ready, False, []

    def apply(self, name: str, serve: bool) -> None:  # runner.serve: idempotent
        self.applied.append((name, serve))
        self.withdrawn = not serve

    def serving(self, name: str) -> bool:
        return self.ready and not self.withdrawn


def test_an_unload_reaches_a_worker_still_loading_before_it_is_ready() -> None:
    repository = SharedRepository(slots=2)
    ready, loading = Worker(ready=True), Worker(ready=False)
    a = Follower(repository, 0, ["m"], ready.apply, ready.serving, lambda: [1])
    b = Follower(repository, 1, ["m"], loading.apply, loading.serving, lambda: [0])
    b.start()  # follows every FOLLOW_S, as in a worker
    try:
        assert a.set("m", False, timeout_s=2.0)
        assert loading.withdrawn  # applied while still loading, not at the first tick after it is ready
        loading.ready = True
        assert not loading.serving("m") and not ready.serving("m")
    finally:
        b.stop()


def test_a_report_from_before_the_change_does_not_agree_with_it() -> None:
    """The CI failure: the second worker reported "not serving" while it loaded, became ready, and the unload
    returned on that stale report; a request it took before its next tick was answered 200."""
    repository = SharedRepository(slots=2)
    first, second = Worker(ready=True), Worker(ready=False)
    a = Follower(repository, 0, ["m"], first.apply, first.serving, lambda: [1])
    b = Follower(repository, 1, ["m"], second.apply, second.serving, lambda: [0])
    b.follow()
    second.ready = True  # between two of its ticks
    assert not a.set("m", False, timeout_s=0.3)  # b does not follow meanwhile: no agreement
    b.start()
    try:
        assert a.set("m", False, timeout_s=2.0)
        assert second.withdrawn and not second.serving("m")
    finally:
        b.stop()


def test_a_change_returns_once_every_worker_has_followed() -> None:
    repository = SharedRepository(slots=2)
    first, second = Worker(ready=True), Worker(ready=True)
    a = Follower(repository, 0, ["m"], first.apply, first.serving, lambda: [1])
    b = Follower(repository, 1, ["m"], second.apply, second.serving, lambda: [0])
    b.follow()
    assert not a.set("m", False, timeout_s=0.3)  # the second worker still serves it: not agreed
    b.start()
    try:
        assert a.set("m", False, timeout_s=2.0) and first.withdrawn and second.withdrawn
        assert a.set("m", True, timeout_s=2.0) and first.serving("m") and second.serving("m")
    finally:
        b.stop()
