"""Which towers of a worker's models are in memory: pinned (loaded at start, never unloaded), lazy (loaded on
first use), or with an idle TTL (unloaded after it, loaded again on demand).

A request waits at admission for the towers it needs (``ensure``), within its deadline: past it, 503
``not_ready`` with the expected load time as Retry-After. While admitted it holds them (``using``), so a tower
is only unloaded with nothing in flight. Loads and unloads run in the worker's loader thread: the inference
thread goes on with the other towers' forwards meanwhile (a search on a pinned text tower while an image
tower comes back). Why these defaults (a CLIP text tower pinned, image towers with a TTL): docs/MODELS.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import gevent
from gevent.event import Event
from gevent.threadpool import ThreadPool

from service import metrics
from service.engine.model_set import LAZY, PINNED, TTL, Residency
from service.errors import Overloaded

log = logging.getLogger(__name__)
REAP_EVERY_S = (1.0, 30.0)  # the TTL sweep runs every quarter TTL, within these bounds
RETRY_LOAD_S = 5.0  # after a failed load, requests get 503 for this long before one tries again


class Tower:
    """One tower's residency (the hub's state): whether it is in memory, and who uses it."""

    def __init__(self, model: str, name: str, residency: Residency, load: Callable[[], None],
                 unload: Callable[[], int], load_s: float, nbytes: int = 0) -> None:
        self.model, self.name, self.residency = model, name, residency
        self.nbytes = nbytes  # what it holds while loaded
        self._load, self._unload = load, unload
        self.resident = Event()
        self.resident.set()  # built with its model; a lazy tower is unloaded right after (``Towers.add``)
        self.busy = 0
        self.last_used = time.monotonic()
        self.load_s = max(load_s, 0.1)  # the expected reload time (refined by each reload)
        self.changing: gevent.Greenlet | None = None
        self.error: BaseException | None = None
        self.failed_at = 0.0


class Towers:
    """Every tower of a worker's models, loaded and unloaded in ``pool`` (the worker's loader thread)."""

    def __init__(self, pool: ThreadPool, max_resident: int = 0) -> None:
        self._pool = pool
        self._max_resident = max_resident  # GREENSERVE_MAX_RESIDENT_TOWERS (0: no cap)
        self._towers: dict[tuple[str, str], Tower] = {}
        self._reaper: gevent.Greenlet | None = None

    def add(self, tower: Tower) -> None:
        self._towers[(tower.model, tower.name)] = tower
        metrics.TOWER_BYTES.labels(tower.model, tower.name).set(tower.nbytes)
        if tower.residency.kind == LAZY:
            self._change(tower, load=False)
        else:
            self._make_room(tower)
        if tower.residency.kind == TTL and self._reaper is None:
            self._reaper = gevent.spawn(self._reap_forever)

    def state(self, model: str, name: str) -> str:
        tower = self._towers.get((model, name))
        return "resident" if tower is None or tower.resident.is_set() else "unloaded"

    def ensure(self, model: str, names: tuple[str, ...], deadline: float) -> None:
        """Until the towers ``model`` needs are in memory, loading those that are not; 503 past ``deadline``."""
        for name in names:
            tower = self._towers.get((model, name))
            while tower is not None and not tower.resident.is_set():
                left = deadline - time.monotonic()
                failed = tower.error is not None and time.monotonic() - tower.failed_at < RETRY_LOAD_S
                if left <= 0 or failed:
                    why = f"failed to load ({tower.error})" if tower.error else "is loading on this worker"
                    raise Overloaded(f"the {name} tower of {model!r} {why}; retry shortly",
                                     retry_after_s=tower.load_s, code="not_ready")
                if tower.changing is None:
                    self._make_room(tower)
                    self._change(tower, load=True)
                assert tower.changing is not None
                tower.changing.join(timeout=left)  # an unload under way ends first, then it loads

    @contextlib.contextmanager
    def using(self, model: str, names: tuple[str, ...]) -> Iterator[None]:
        """While a request holds its towers: none of them is unloaded."""
        held = [t for name in names if (t := self._towers.get((model, name))) is not None]
        for tower in held:
            tower.busy += 1
        try:
            yield
        finally:
            now = time.monotonic()
            for tower in held:
                tower.busy -= 1
                tower.last_used = now

    def changing(self, model: str) -> bool:
        """Some tower of ``model`` is being loaded or unloaded now."""
        return any(t.changing is not None for (m, _), t in self._towers.items() if m == model)

    def unload_model(self, model: str) -> gevent.Greenlet:
        """Every tower of ``model`` out of memory, pinned ones too, once the requests holding them are done
        (the model is no longer admitted: the repository API unloaded it)."""
        return gevent.spawn(self._unload_model, model)

    def load_model(self, model: str, done: Callable[[], None]) -> gevent.Greenlet:
        """Every tower of ``model`` back (a lazy one stays out until used), then ``done()``."""
        return gevent.spawn(self._load_model, model, done)

    def _unload_model(self, model: str) -> None:
        for tower in [t for (m, _), t in self._towers.items() if m == model]:
            while tower.busy or tower.changing is not None:
                gevent.sleep(0.05)
            if tower.resident.is_set():
                self._change(tower, load=False)
                assert tower.changing is not None
                tower.changing.join()

    def _load_model(self, model: str, done: Callable[[], None]) -> None:
        for tower in [t for (m, _), t in self._towers.items() if m == model and t.residency.kind != LAZY]:
            if tower.changing is not None:
                tower.changing.join()
            if not tower.resident.is_set():
                self._change(tower, load=True)
                assert tower.changing is not None
                tower.changing.join()
        done()

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.kill()

    def _reap_forever(self) -> None:
        while True:
            ttls = [t.residency.ttl_s for t in self._towers.values() if t.residency.kind == TTL]
            gevent.sleep(min(max(min(ttls) / 4, REAP_EVERY_S[0]), REAP_EVERY_S[1]))
            now = time.monotonic()
            for tower in self._towers.values():
                if (tower.residency.kind == TTL and tower.resident.is_set() and not tower.busy
                        and tower.changing is None and now - tower.last_used >= tower.residency.ttl_s):
                    self._change(tower, load=False)

    def _make_room(self, coming: Tower) -> None:
        """Under GREENSERVE_MAX_RESIDENT_TOWERS, unload the least recently used towers that are not pinned (nor
        held by a request) until ``coming`` fits; pinned ones alone may still go past the cap."""
        while self._max_resident:
            resident = [t for t in self._towers.values() if t is not coming and t.resident.is_set()]
            spare = [t for t in resident if t.residency.kind != PINNED and not t.busy and t.changing is None]
            if len(resident) < self._max_resident or not spare:
                return
            self._change(min(spare, key=lambda t: t.last_used), load=False)

    def _change(self, tower: Tower, *, load: bool) -> None:
        if not load:
            tower.resident.clear()  # from now on a request waits for it to come back
        tower.error = None
        tower.changing = gevent.spawn(self._run_change, tower, load)

    def _run_change(self, tower: Tower, load: bool) -> None:
        started = time.monotonic()
        try:
            if load:
                self._pool.apply(tower._load)
                tower.load_s = time.monotonic() - started
                tower.resident.set()
                metrics.TOWER_LOADS.labels(tower.model, tower.name).inc()
                metrics.TOWER_BYTES.labels(tower.model, tower.name).set(tower.nbytes)
                log.info("%s: %s tower loaded again in %.2fs", tower.model, tower.name, tower.load_s)
            else:
                freed = self._pool.apply(tower._unload)
                metrics.TOWER_UNLOADS.labels(tower.model, tower.name).inc()
                metrics.TOWER_BYTES.labels(tower.model, tower.name).set(0)
                log.info("%s: %s tower unloaded (%s, %.0f MB)", tower.model, tower.name, tower.residency.kind,
                         freed / 1e6)
        except gevent.GreenletExit:
            raise
        except Exception as exc:
            log.error("%s: the %s tower failed to %s: %s", tower.model, tower.name, "load" if load else "unload",
                      exc, exc_info=True)
            if load:  # a tower that cannot come back fails its requests (503, saying why) until one retries
                tower.error, tower.failed_at = exc, time.monotonic()
            else:  # its tensors are still there (the file is written before they go): it stays, and is kept
                tower.residency = Residency(PINNED)
                tower.resident.set()
        finally:
            tower.changing = None
