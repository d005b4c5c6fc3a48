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
