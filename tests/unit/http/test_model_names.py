"""The protocols' model names: ``<m>`` for the classes, ``<m>-embedding`` for the embeddings, else 404."""

from __future__ import annotations

import pytest

from service.errors import NotFound
from service.http import model_names
from service.http.model_names import Target


def test_the_plain_name_is_the_classes_and_the_suffixed_one_the_embeddings() -> None:
    assert model_names.resolve("resnet50", "resnet50") == Target("resnet50", "classify")
    assert model_names.resolve("resnet50", "resnet50-embedding") == Target("resnet50", "embeddings")


@pytest.mark.parametrize("asked", ["resnet18", "resnet50-embeddings", "", "resnet50/1"])
def test_any_other_name_is_404_naming_both(asked: str) -> None:
    with pytest.raises(NotFound) as raised:
        model_names.resolve("resnet50", asked)
    assert raised.value.code == "model_not_found" and "'resnet50-embedding'" in raised.value.message


def test_oip_names_the_model_plainly() -> None:
    assert model_names.resolve_plain("resnet50", "resnet50") == "resnet50"
    with pytest.raises(NotFound, match="Request for unknown model"):
        model_names.resolve_plain("resnet50", "resnet50-embedding")


def test_the_listed_names_have_the_embedding_only_for_a_model_that_embeds() -> None:
    assert model_names.names("m") == ["m", "m-embedding"]
    assert model_names.names("m", ("classify",)) == ["m"]


def test_the_served_name_is_the_configured_one_until_the_model_has_loaded() -> None:
    assert model_names.served_name(None, "open_clip:ViT-B-32") == "open_clip:ViT-B-32"


# ---------------------------------------------------------------------- immich's <architecture>__<tag>

IMMICH_SERVED = {"search": ("open_clip:ViT-B-32", "laion2b_s34b_b79k"), "ViT-B-16-SigLIP__webli": (
    "open_clip:ViT-B-16-SigLIP", "/srv/siglip.safetensors"), "labels": ("resnet50", "imagenet"),
    "open_clip:nllb-clip-base-siglip__v1": ("open_clip:nllb-clip-base-siglip__v1", "auto")}


@pytest.mark.parametrize(("asked", "served"), [
    ("ViT-B-16-SigLIP__webli", "ViT-B-16-SigLIP__webli"),  # named so: its weights come from a file
    ("immich-app/ViT-B-16-SigLIP__webli", "ViT-B-16-SigLIP__webli"),  # immich drops what comes before a "/"
    ("ViT-B-32__laion2b-s34b-b79k", "search"),  # immich's spelling of open_clip's laion2b_s34b_b79k
    ("ViT-B-32__laion2b_s34b_b79k", "search"),
    ("vit-b-32::laion2b_s34b_b79k", "search"),  # ":" is "_" to immich; the architecture in any case
    ("nllb-clip-base-siglip__v1", "open_clip:nllb-clip-base-siglip__v1"),  # GREENSERVE_MODEL=open_clip:<immich's name>
])
def test_an_immich_name_is_a_served_name_or_its_architecture_and_tag(asked: str, served: str) -> None:
    assert model_names.resolve_immich(IMMICH_SERVED, asked) == served


@pytest.mark.parametrize("asked", ["ViT-B-32__openai", "ViT-L-14__laion2b-s32b-b82k", "XLM-Roberta-Large-Vit-B-32",
                                   "ViT-B-16-SigLIP-384__webli", "search-embedding"])
def test_any_other_immich_name_is_404_naming_what_is_served(asked: str) -> None:
    with pytest.raises(NotFound) as raised:
        model_names.resolve_immich(IMMICH_SERVED, asked)
    message = raised.value.message
    assert raised.value.code == "model_not_found" and "'search' (open_clip:ViT-B-32 with weights laion2b_s34b_b79k)" in message
    assert "/srv/" not in message and "from a file" in message  # a path on the server is not the client's to see


def test_a_served_name_that_its_configuration_contradicts_is_refused() -> None:
    served = {"ViT-B-32__openai": ("open_clip:ViT-L-14", "laion2b_s32b_b82k"), "ViT-B-16__openai": ("resnet50", "random"),
              "ViT-L-14__openai": ("open_clip:ViT-L-14__laion2b-s32b-b82k", "auto")}
    for asked in served:
        with pytest.raises(NotFound, match="fix GREENSERVE_MODELS"):
            model_names.resolve_immich(served, asked)


def test_the_immich_way_is_preferred_to_open_clips_for_the_same_weights() -> None:
    served = {"plain": ("open_clip:ViT-B-32", "openai"), "exact": ("open_clip:ViT-B-32__openai", "auto")}
    assert model_names.resolve_immich(served, "ViT-B-32__openai") == "exact"


def test_a_served_name_without_a_tag_is_served_as_named() -> None:
    assert model_names.resolve_immich({"clip": ("open_clip:ViT-B-32", "random")}, "clip") == "clip"
