"""The load board: each live worker's load and kept connections, in shared memory the master allocates
before forking. Torch-free and metric-free: the master imports it."""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

from service.balance.memo import SharedMemo
from service.balance.repository import SharedRepository

SLOTS = 256  # more than any worker count; a dead worker's slot is reused by its replacement
# The load a worker publishes while it must not be deferred to: its model is loading or failed, or it is
# shutting down. Siblings then take the connections; borrowing counts it as busy.
UNAVAILABLE = 1 << 30


class LoadBoard:
    def __init__(self, slots: int = SLOTS) -> None:
        # RawArray: anonymous shared memory, inherited by every forked worker; single-word writes only
        self._alive = multiprocessing.RawArray("b", slots)
        self._load = multiprocessing.RawArray("i", slots)
        self._kept = multiprocessing.RawArray("i", slots)
        self._open = multiprocessing.RawArray("b", slots)  # the worker's listeners accept now
        self._leaving = multiprocessing.RawArray("b", slots)  # an old worker handing over after a reload
        self._top = multiprocessing.RawValue("i", 0)  # slots in use are below this: reads scan only those
        # when a worker last started a request while a sibling had one (CLOCK_MONOTONIC: one clock per host)
        self._overlap_at = multiprocessing.RawValue("d", float("-inf"))
        self._reload_at = multiprocessing.RawValue("d", float("-inf"))  # the master's last HUP (CLOCK_MONOTONIC)
        self.name = os.urandom(6).hex()  # this master's board: its workers' doorbells are named for it

    def claim(self) -> int:
        """Master, before fork: the first free slot, marked alive and unavailable until its model is ready."""
        for i in range(len(self._alive)):
            if not self._alive[i]:
                self._alive[i], self._load[i], self._kept[i], self._open[i], self._leaving[i] = 1, UNAVAILABLE, 0, 0, 0
                self._top.value = max(self._top.value, i + 1)
                return i
        raise RuntimeError(f"more than {len(self._alive)} live workers")

    def release(self, slot: int) -> None:
        """Master, when a worker exits."""
        self._alive[slot], self._load[slot], self._kept[slot], self._open[slot], self._leaving[slot] = 0, 0, 0, 0, 0

    def publish(self, slot: int, load: int, kept: int) -> None:
        self._load[slot], self._kept[slot] = load, kept

    def mark_leaving(self, slot: int) -> None:
        self._leaving[slot] = 1

    def generations(self, slot: int) -> tuple[int, int, int]:
        """Among the other live workers that serve (not loading, failed or draining): (ready workers of the
        new generation, old ones handing over, old ones handing over in a lower slot)."""
        new = old = old_below = 0
        for i in range(self._top.value):
            if i == slot or not self._alive[i] or self._load[i] >= UNAVAILABLE:
                continue
            if self._leaving[i]:
                old += 1
                old_below += i < slot
            else:
                new += 1
        return new, old, old_below

    def any_serving(self, slot: int) -> bool:
        """Some other live worker serves (its model is ready, and it is not draining)."""
        return any(self._load[i] < UNAVAILABLE for i in self.others(slot))

    def publish_open(self, slot: int, accepting: bool) -> None:
        self._open[slot] = accepting

    def any_open(self, slot: int) -> bool:
        """Some other live worker's listeners accept now."""
        return any(self._open[i] for i in self.others(slot))

    def others(self, slot: int) -> list[int]:
        """The slots of every other live worker."""
        return [i for i in range(self._top.value) if i != slot and self._alive[i]]

    def mark_overlap(self, now: float) -> None:
        self._overlap_at.value = now

    def overlap_at(self) -> float:
        """When two workers last had requests at once (``-inf``: never)."""
        return float(self._overlap_at.value)

    def mark_reload(self, now: float) -> None:
        """Master, on HUP, before it spawns the new workers and stops the old ones."""
        self._reload_at.value = now

    def reload_at(self) -> float:
        return float(self._reload_at.value)

    def siblings(self, slot: int) -> list[tuple[int, int]]:
        """(load, kept connections) of every other live worker."""
        return [(self._load[i], self._kept[i]) for i in self.others(slot)]


@dataclass(frozen=True)
class Seat:
    """A worker's place on the board: made by the master in ``pre_fork``, inherited by the worker."""

    board: LoadBoard
    slot: int
    memo: SharedMemo | None = None  # what earlier workers of this master measured (``memo``)
    repository: SharedRepository | None = None  # which configured models the workers serve (``repository``)

    def release(self) -> None:
        self.board.release(self.slot)
