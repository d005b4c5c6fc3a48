"""The model's own preprocessing facts (torchvision's ``weights.transforms()``, open_clip's preprocess config),
as plain data."""

from __future__ import annotations

from dataclasses import dataclass

# ImageNet preprocessing used by torchvision's classification weights (resnet50 V2 uses 232/224).
DEFAULT_RESIZE = 256
DEFAULT_CROP = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Transform:
    resize_size: int = DEFAULT_RESIZE
    crop_size: int = DEFAULT_CROP
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"
    resize_mode: str = "shortest"  # shortest side to resize_size, then centre crop | squash: whole image to crop

    def crop_box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The source region (left, top, right, bottom) that resizing the shorter side to ``resize_size`` and
        centre-cropping ``crop_size`` keeps; the whole image for ``squash``."""
        if self.resize_mode == "squash":
            return 0.0, 0.0, float(width), float(height)
        half = self.crop_size / (self.resize_size / min(width, height)) / 2
        cx, cy = width / 2, height / 2
        return max(0.0, cx - half), max(0.0, cy - half), min(float(width), cx + half), min(float(height), cy + half)
