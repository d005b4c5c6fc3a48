"""One tower's weights out of memory and back: ``TowerFile``.

A tower (a model's image or text half) is unloaded by dropping its tensors, and loaded again by mapping them
from one file per host: the tower's tensors as served (after any cast), saved once by the first worker that
unloads it, under the cache directory and named by the weights' digest. A reload reads pages of the page cache
(shared by the host's workers), not a download or a rebuild, and an unload gives back what the tower held:
its private copies, or its share of the mapped pages.

The tensors keep their ``nn.Parameter`` objects (only ``.data`` changes), so the modules, their hooks and the
casts' bookkeeping stay as they were. Runs in a loader thread, never while a forward of the tower runs (the
engine's residency sees to it).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


class TowerFile:
    def __init__(self, root: nn.Module, skip: tuple[str, ...], path: Path) -> None:
        self.path = path
        self._tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
            if id(t) not in seen and not name.startswith(skip):
                seen.add(id(t))
                self._tensors[name] = t

    def nbytes(self) -> int:
        """What the tower's tensors take while loaded."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def unload(self) -> int:
        """Save the tower once (if this host has no file of it yet), then drop its tensors; the bytes dropped."""
        if not self.path.exists():
            self._save()
        dropped = self.nbytes()
        with torch.no_grad():
            for t in self._tensors.values():
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        return dropped

    def rebase(self) -> None:
        """Put the tower on its file now (saved if this host has none): its tensors become pages of the page
        cache, one copy for every worker of the host, and an unload later gives them back for certain (a
        checkpoint read whole leaves its towers as slices of one allocation that no unload could free)."""
        if not self.path.exists():
            self._save()
        self.load()

    def load(self) -> None:
        """Map the tower's tensors back from its file."""
        saved = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
        missing = sorted(set(self._tensors) - set(saved))
        if missing:
            raise RuntimeError(f"{self.path} lacks {len(missing)} of the tower's tensors ({missing[0]}, ...); "
                               "remove the file and restart")
        with torch.no_grad():
            for name, t in self._tensors.items():
                t.data = saved[name].to(t.device)

    def _save(self) -> None:
        """Atomically: a worker reading the file never sees half of it (two saving at once write the same)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        try:
            with os.fdopen(fd, "wb") as out:
                torch.save({name: t.detach().cpu() for name, t in self._tensors.items()}, out)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def tower_files(model: object, directory: Path) -> dict[str, TowerFile]:
    """Each tower of a loaded model and its file under ``directory``, named by what decides its tensors (the
    weights' digest, the tower, its numerics); none for a model that does not say where its towers are."""
    roots = getattr(model, "tower_roots", None)
    info = getattr(model, "info", None)
    if not roots or info is None or not info.weights_digest:
        return {}
    numerics = getattr(model, "numerics", {})
    files = {}
    for tower, (root, skip) in roots.items():
        kind = numerics[tower].name.replace(" ", "-") if tower in numerics else "float32"
        files[tower] = TowerFile(root, skip, directory / f"{info.weights_digest}-{tower}-{kind}.pt")
    return files


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc keeps freed memory for reuse: without this, an unloaded
    tower's memory stays in the process's RSS); nothing where the C library is not glibc."""
    process = ctypes.CDLL(None)  # the symbols already loaded: no library lookup (it runs a subprocess)
    if hasattr(process, "malloc_trim"):
        process.malloc_trim(0)


def reload(model: Any, tower: str, file: TowerFile) -> None:
    """In the loader thread: a tower's tensors mapped back, and one forward through it (its first-call costs
    paid here, not by the request waiting for it)."""
    file.load()
    if tower == "image":
        crop = model.info.transform.crop_size
        model.forward(np.zeros((1, crop, crop, 3), np.uint8))
    else:
        model.encode_text(model.tokenize(["a photo."]).ids)


def unload(file: TowerFile) -> int:
    """In the loader thread: the tower's tensors dropped, and what the heap freed given back; the bytes."""
    freed = file.unload()
    give_back_freed_memory()
    return freed
