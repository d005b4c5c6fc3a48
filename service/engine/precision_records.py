"""Where a precision choice is kept, so that others serve it instead of timing again (``precision.settle``):

    Memo        the server's, in the master's shared memory (``balance.memo.SharedMemo``): a worker that
                replaces another (a HUP, a respawn) serves what was measured at the server's start
    FleetStore  the fleet's, beside its cache entries (``cache.fleet.FleetRecords``: the shared Redis): the first
                instance to measure records its choice, set-if-absent, and every other instance adopts it

Both keep a ``Record`` under ``trial_key``: everything the choice depends on (the weights' digest, the model,
the device, the hardware in words, the sizes timed, the settings, the towers, torch's version), so only an
instance that would measure the same thing adopts it. Two instances that time alike within noise still pick
differently often enough (issue 40: cast once on one, autocast on the other); their cache keys then differ and
neither finds the other's entries. A fleet with one record answers in one numerics, and shares its entries.

A fleet store that cannot be read measures here; one that cannot be written serves what was measured here.
Both are logged, neither fails the start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from service.engine.casting import BY_NAME
from service.engine.model import LoadedModel
from service.engine.types import TowerChoice

log = logging.getLogger(__name__)
REUSED = "as measured when this server started: "  # the reason's prefix for a choice read from the memo
ADOPTED = "as measured by the fleet ({where}, by {by}): "  # ... and for one read from the fleet's record


class Memo(Protocol):
    """Where a server's workers keep what they measured (``service.balance.memo.SharedMemo``)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> bool: ...

    def exclusive(self, timeout_s: float) -> contextlib.AbstractContextManager[bool]: ...


class FleetStore(Protocol):
    """Where a fleet's instances keep their choice (``service.cache.fleet.FleetRecords``). Every call raises
    ``ConnectionError`` when the store cannot answer."""

    where: str  # the store in words, for the log and the reason: "redis at 10.0.0.5:6379/0"

    def get(self, key: str) -> bytes | None: ...

    def put_first(self, key: str, value: bytes) -> bytes | None: ...  # set-if-absent; what the store now keeps

    def close(self) -> None: ...  # its connections, once the choice is made


@dataclass(frozen=True)
class Record:
    """A choice as kept: each tower's numerics (by name), its reason and sizes, and who timed it."""

    towers: tuple[tuple[str, str, str, tuple[int, ...], tuple[float, ...]], ...]  # ms: what it serves in, timed
    by: str  # "<host> pid <pid>" of the worker that timed it

    @classmethod
    def of(cls, choices: Sequence[TowerChoice], by: str) -> Record:
        return cls(tuple((c.tower, c.numerics, c.reason, tuple(c.sizes), tuple(c.ms)) for c in choices), by)

    def encode(self, key: str) -> bytes:
        return json.dumps({"key": key, "by": self.by, "towers": [list(t) for t in self.towers]}).encode()


def decode(key: str, blob: bytes | None) -> Record | None:
    """The record kept under ``key`` in ``blob``; None for nothing, another key's, or anything damaged."""
    if not blob:
        return None
    try:
        value = json.loads(blob)
        if not isinstance(value, dict) or value.get("key") != key:
            return None
        towers = tuple(_tower(*t) for t in value["towers"])
        if not all(numerics in BY_NAME for _, numerics, _, _, _ in towers):
            return None
        return Record(towers, str(value["by"]))
    except (ValueError, KeyError, TypeError):
        return None


def _tower(tower: Any, numerics: Any, reason: Any, sizes: Any, ms: Any = ()) -> tuple[str, str, str, tuple[int, ...],
                                                                                    tuple[float, ...]]:
    """One tower's choice as kept; one kept before the served way's times were (no ``ms``) reads back untimed."""
    return str(tower), str(numerics), str(reason), tuple(int(s) for s in sizes), tuple(float(m) for m in ms)


def trial_key(model: LoadedModel, requested: str, cpu_bf16: str, hardware: str,
              sizes: dict[str, tuple[int, ...]], runtimes: tuple[str, ...] = ()) -> str:
    """Everything a trial's outcome depends on besides the clock (``runtimes``: the others tried, versioned)."""
    info = model.info
    key = {"model": [info.family, info.name, info.weights, info.weights_digest], "device": str(model.device),
           "requested": requested, "cpu_bf16": cpu_bf16, "hardware": hardware, "sizes": sizes,
           "towers": list(model.towers), "torch": torch.__version__}
    if runtimes:  # absent otherwise: the records kept before other runtimes were tried still match
        key["runtimes"] = list(runtimes)
    return json.dumps(key, sort_keys=True)


def this_process() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


def read_fleet(fleet: FleetStore | None, key: str) -> tuple[Record | None, bool]:
    """The fleet's record under ``key`` (None: there is none yet, or no fleet), and whether the store answered."""
    if fleet is None:
        return None, False
    try:
        blob = fleet.get(key)
    except ConnectionError as exc:
        log.warning("precision: the fleet's record at %s could not be read (%s); measuring here, so this instance "
                    "may choose other numerics than the fleet (and miss its cache entries)", fleet.where, exc)
        return None, False
    found = decode(key, blob)
    if blob and found is None:
        log.warning("precision: the fleet's record at %s is damaged; measuring here", fleet.where)
    elif found is not None:
        log.info("precision: as measured by the fleet (%s, by %s); not timed here", fleet.where, found.by)
    return found, True


def offer(fleet: FleetStore, key: str, ours: Record) -> Record:
    """Record ``ours`` for the fleet unless another instance did first; the record the fleet keeps."""
    try:
        kept = decode(key, fleet.put_first(key, ours.encode(key)))
    except ConnectionError as exc:
        log.warning("precision: the fleet's record at %s could not be written (%s); serving what was measured "
                    "here, and the next instance measures again", fleet.where, exc)
        return ours
    if kept is None:  # a damaged record that set-if-absent keeps, or one gone at once (evicted)
        log.warning("precision: the fleet's record at %s could not be read back; serving what was measured here",
                    fleet.where)
        return ours
    if kept == ours:
        log.info("precision: measured here and recorded for the fleet at %s", fleet.where)
        return ours
    log.info("precision: %s recorded the fleet's choice at %s first; serving it, as the fleet does", kept.by,
             fleet.where)
    return kept
