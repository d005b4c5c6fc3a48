"""The master imports the model's libraries once, before it forks: each worker then starts with them.

Importing torch, torchvision and a family's library costs a worker seconds of CPU (torchvision alone pulls in
torch._dynamo), and after a HUP or a respawn that CPU came from the cores the serving workers use
(docs/SCHEDULING.md#hand-over). Imported in the master, a new worker only builds its app and loads its model.

Importing is fork-safe where running is not: no OpenMP thread, CUDA context or torch thread pool exists until
a worker's first forward (the one thread an import starts is OpenBLAS's, which handles fork). Only these
third-party libraries come in, never greenserve's own modules, so a HUP still loads new application code; a
new torch or open_clip needs a restart, as with any library the master has imported.
"""

from __future__ import annotations

import gc
import importlib
import time

# what each model family's worker imports (``service.engine.loading``'s families): torchvision is always
# imported, for the decode pipeline's transforms
LIBRARIES = {"torchvision": ("torch", "torchvision"), "open_clip": ("torch", "torchvision", "open_clip"),
             "timm": ("torch", "torchvision", "timm")}


def libraries_for(model: str) -> tuple[str, ...]:
    """``GREENSERVE_MODEL`` → the libraries its worker imports (a bare name is torchvision's; a bad family
    imports the common two, and the worker reports the name)."""
    family, sep, _ = model.partition(":")
    return LIBRARIES.get(family if sep else "torchvision", LIBRARIES["torchvision"])


def preimport(model: str) -> float:
    """Import ``model``'s libraries here (the master, before any fork) and freeze them out of the garbage
    collector; returns the seconds it took. A library
    that fails to import is left to the worker, which reports it with the model's load."""
    start = time.monotonic()
    for name in libraries_for(model):
        try:
            importlib.import_module(name)
        except ImportError:
            break
    # The imported objects are the workers' too, in pages shared with the master until written. A worker's
    # garbage collector would write to every one it scans (reference counts, links), copying those pages
    # into each worker; frozen, it never scans them.
    gc.freeze()
    return time.monotonic() - start
