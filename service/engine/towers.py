"""One tower's weights out of memory and back: ``TowerFile``.

A tower (a model's image or text half) is unloaded by dropping its tensors, and loaded again by mapping them
from one file per host: the tower's tensors as served (after any cast), saved once by the first worker that
unloads it, under the cache directory and named by the weights' digest. A reload reads pages of the page cache
(shared by the host's workers), not a download or a rebuild, and an unload gives back what the tower held:
its private copies, or its share of the mapped pages.

The file is safetensors: its load maps the file and builds the tensors in native code (about 2 ms for
ViT-S-32's image tower, against 7 ms of torch.load's Python unpickler, which holds the GIL that the inference
thread's forward of a search needs meanwhile). A tensor's memory layout (channels_last) is kept by saving it in
its storage order and permuting it back on load.

The tensors keep their ``nn.Parameter`` objects (only ``.data`` changes), so the modules, their hooks and the
casts' bookkeeping stay as they were. Runs in a loader thread, never while a forward of the tower runs (the
engine's residency sees to it).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

ORDER = "order:"  # metadata key prefix: a tensor's dims in storage order, where that is not their own order


class TowerFile:
    def __init__(self, root: nn.Module, skip: tuple[str, ...], path: Path) -> None:
        self.path = path
        self._tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
            if id(t) not in seen and not name.startswith(skip):
                seen.add(id(t))
                self._tensors[name] = t
        self._shapes = {name: t.shape for name, t in self._tensors.items()}  # an unload empties the tensors

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
        with safe_open(self.path, framework="pt") as saved:  # mapped, not read
            orders = saved.metadata() or {}
            tensors = {name: _from_storage_order(saved.get_tensor(name), orders.get(ORDER + name))
                       for name in saved.keys()}
        wrong = sorted(n for n, shape in self._shapes.items() if n not in tensors or tensors[n].shape != shape)
        if wrong:
            raise RuntimeError(f"{self.path} lacks {len(wrong)} of the tower's tensors as served ({wrong[0]}, ...); "
                               "remove the file and restart")
        with torch.no_grad():
            for name, t in self._tensors.items():
                t.data = tensors[name].to(t.device)

    def _save(self) -> None:
        """Atomically: a worker reading the file never sees half of it (two saving at once write the same)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        os.close(fd)
        try:
            stored = {name: _in_storage_order(t.detach().cpu()) for name, t in self._tensors.items()}
            save_file({name: t for name, (t, _) in stored.items()}, tmp,
                      metadata={ORDER + name: order for name, (_, order) in stored.items() if order})
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _in_storage_order(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """``t`` with its dims permuted into storage order (contiguous without a copy for a channels_last weight),
    and that order ("" when it is the tensor's own); any other layout is copied into its own order."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    if order == sorted(order) or not t.permute(order).is_contiguous():
        return t.contiguous(), ""
    return t.permute(order), ",".join(map(str, order))


def _from_storage_order(t: torch.Tensor, order: str | None) -> torch.Tensor:
    """A tensor saved by ``_in_storage_order`` back in its own dims, with its strides as they were."""
    if not order:
        return t
    dims = [int(d) for d in order.split(",")]
    return t.permute([dims.index(d) for d in range(len(dims))])


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
        files[tower] = TowerFile(root, skip, directory / f"{info.weights_digest}-{tower}-{kind}.safetensors")
    return files


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc keeps freed memory for reuse: without this, an unloaded
    tower's memory stays in the process's RSS); nothing where the C library is not glibc."""
    process = ctypes.CDLL(None)  # the symbols already loaded: no library lookup (it runs a subprocess)
    if hasattr(process, "malloc_trim"):
        process.malloc_trim(0)


def reload(file: TowerFile) -> None:
    """In the loader thread: a tower's tensors mapped back. No warm-up forward here: it would run beside the
    inference thread's forwards on the same cores (a search during a reload took 2.3x its idle time, the reload
    0.55 s against 0.2 s without it); the request waiting for the tower pays its first forward's extra ~10 ms instead."""
    file.load()


def unload(file: TowerFile) -> int:
    """In the loader thread: the tower's tensors dropped, and what the heap freed given back; the bytes."""
    freed = file.unload()
    give_back_freed_memory()
    return freed
