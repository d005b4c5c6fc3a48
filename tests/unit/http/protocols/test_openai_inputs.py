"""How an OpenAI ``input`` is read: on a model with a text tower a string is a text (and never something
to fetch); on an image-only model it is an image reference; objects and ``modality`` say it outright."""

from __future__ import annotations

from typing import Any

import pytest

from service.engine.types import ModelInfo, Transform
from service.errors import RequestError
from service.http.protocols import openai
from service.settings import Settings

SETTINGS = Settings(image_base_url="http://images.example/")
CLIP = ModelInfo("clip", ("embeddings", "classify", "rank"), 4, (), "cpu", "float32", "random", Transform(8, 8),
                 towers=("image", "text"), family="open_clip")
RESNET = ModelInfo("resnet", ("embeddings", "classify"), 4, ("a", "b"), "cpu", "float32", "random", Transform(8, 8))


def parse(info: ModelInfo, **doc: Any) -> Any:
    req, _ = openai.parse({"model": info.name, **doc}, SETTINGS, {info.name: info})
    return req


def test_a_string_on_clip_is_a_text_and_nothing_is_fetched() -> None:
    req = parse(CLIP, input=["a dog on a beach", "holiday/2024.jpg"])
    assert req.text.texts == ("a dog on a beach", "holiday/2024.jpg") and req.refs == ()
    assert parse(CLIP, input="one query").text.texts == ("one query",)


def test_images_on_clip_are_objects_or_strings_with_modality_image() -> None:
    by_object = parse(CLIP, input=[{"image": "https://a.example/x.jpg"}, {"url": "y.jpg"}])
    assert [r.url for r in by_object.refs] == ["https://a.example/x.jpg", "http://images.example/y.jpg"]
    by_modality = parse(CLIP, input=["y.jpg"], modality="image")
    assert [r.url for r in by_modality.refs] == ["http://images.example/y.jpg"] and not by_modality.text.texts


def test_a_string_on_an_image_only_model_stays_an_image() -> None:
    req = parse(RESNET, input=["y.jpg"])
    assert [r.url for r in req.refs] == ["http://images.example/y.jpg"] and not req.text.texts
    assert parse(RESNET, input=["a cat"], modality="text").text.texts == ("a cat",)  # then refused: no text tower


@pytest.mark.parametrize("items", [["a dog", {"image": "https://a.example/x.jpg"}],
                                   [{"text": "a dog"}, {"url": "x.jpg"}]])
def test_one_kind_per_request_and_the_message_says_how(items: list[Any]) -> None:
    with pytest.raises(RequestError, match="modality"):
        parse(CLIP, input=items)


def test_token_arrays_name_langchains_setting() -> None:
    with pytest.raises(RequestError, match="check_embedding_ctx_length=False") as err:
        parse(CLIP, input=[[101, 2023, 102]])
    assert err.value.code == "token_input_not_supported"
