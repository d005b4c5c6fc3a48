"""What the tests' real servers run: the small models, the token, and the environment they start from."""

from __future__ import annotations

from pathlib import Path

from harness.imagehost import ImageHost

GUARD_TOKEN = "s3cret-e2e"  # the ``guarded`` server's GREENSERVE_API_TOKEN
CLIP_ARCH = "ViT-S-32-alt"  # 43 M parameters: the smallest open_clip CLIP with both towers
E2E_MODEL = "resnet18"  # small real torchvision model; weights saved to a temp file (no download here)
# a CLIP server's text limits
CLIP_LIMITS = {"GREENSERVE_MAX_TEXTS": "16", "GREENSERVE_MAX_TEXT_CHARS": "600", "GREENSERVE_MAX_LABELS": "20"}
# what a test of the model's own work sends: every image embedded again, not answered by the embedding cache
MODEL_WORK = {"Cache-Control": "no-cache"}


def e2e_env(weights_file: Path, image_host: ImageHost, **extra: str) -> dict[str, str]:
    """A server's environment. The dtype is pinned to float32: these servers are checked against each
    other's routes and against float32 references to 1e-6, and on a CPU with native bfloat16 the default
    (auto) would serve bfloat16. ``tests/e2e/test_e2e_precision_decode.py`` runs the default."""
    env = {"GREENSERVE_MODEL": E2E_MODEL, "GREENSERVE_WEIGHTS": str(weights_file), "GREENSERVE_DTYPE": "float32",
           "GREENSERVE_IMAGE_BASE_URL": image_host.base_url, "GREENSERVE_MAX_IMAGES": "40",
           "GREENSERVE_MAX_BODY_BYTES": str(8 * 1024 * 1024), "GREENSERVE_MAX_IMAGE_PIXELS": "30000000",
           "GREENSERVE_FETCH_TIMEOUT_S": "2", "GREENSERVE_LOG_LEVEL": "info"}
    env.update(extra)
    return env
