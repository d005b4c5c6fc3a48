"""The open_clip family without a server: loading paths, the trimmed text forward, tokens, the local cache."""

from __future__ import annotations

import random
import string
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.engine.loading import load_model, parse_model_name
from service.engine.types import ModelLoadError
from service.settings import Settings, SettingsError

pytestmark = pytest.mark.slow  # real models: not in make test-fast

ARCH = "ViT-S-32-alt"


@pytest.fixture(scope="module")
def plain_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    import open_clip

    torch.manual_seed(3)
    model = open_clip.create_model(ARCH, pretrained=None).eval()
    path = tmp_path_factory.mktemp("oc") / "plain.pt"
    torch.save(model.state_dict(), path)
    return path, model


def test_model_names_pick_their_family() -> None:
    assert parse_model_name("resnet50") == ("torchvision", "resnet50")
    assert parse_model_name("torchvision:resnet50") == ("torchvision", "resnet50")
    assert parse_model_name("open_clip:ViT-B-32") == ("open_clip", "ViT-B-32")
    with pytest.raises(ModelLoadError, match="family must be one of"):
        parse_model_name("onnx:resnet50")


def test_a_plain_state_dict_loads_mapped_with_the_causal_mask_rebuilt(plain_state: tuple[Path, torch.nn.Module]) -> None:
    path, reference = plain_state
    model = load_model(f"open_clip:{ARCH}", str(path))
    clip = model.module.clip
    assert torch.equal(clip.attn_mask, reference.attn_mask)
    assert not any(t.is_meta for t in clip.state_dict().values())
    pixels = np.random.default_rng(0).integers(0, 255, (2, 224, 224, 3), dtype=np.uint8)
    feats, logits = model.forward(pixels)
    mean = torch.tensor(model.info.transform.mean).view(1, 3, 1, 1)
    std = torch.tensor(model.info.transform.std).view(1, 3, 1, 1)
    with torch.inference_mode():
        expected = reference.encode_image((torch.from_numpy(pixels).permute(0, 3, 1, 2) / 255 - mean) / std)
    assert logits is None and feats is not None
    assert torch.allclose(feats, expected, atol=1e-4)


def test_the_trimmed_text_forward_equals_the_full_context_one(plain_state: tuple[Path, torch.nn.Module]) -> None:
    import open_clip

    path, reference = plain_state
    model = load_model(f"open_clip:{ARCH}", str(path))
    texts = ["a cat", "a photo of a dog on the beach", "x"]
    tokens = model.tokenize(texts)
    assert tokens.lengths == (4, 10, 3) and tokens.truncated == (False, False, False)
    assert np.array_equal(tokens.ids, open_clip.get_tokenizer(ARCH)(texts).numpy())
    ours = model.encode_text(tokens.ids)
    with torch.inference_mode():
        full = reference.encode_text(torch.from_numpy(tokens.ids))
    assert torch.allclose(ours, full, atol=1e-5)


def test_tokens_past_the_context_length_are_cut_keeping_the_end_token(plain_state: tuple[Path, torch.nn.Module]) -> None:
    model = load_model(f"open_clip:{ARCH}", str(plain_state[0]))
    tokens = model.tokenize(["word " * 200])
    assert tokens.lengths == (77,) and tokens.truncated == (True,)
    assert tokens.ids[0, -1] == 49407  # open_clip's end-of-text token closes a cut text too


@pytest.fixture(scope="module")
def clip_text() -> Any:
    """The text tower's tokenizing alone (no weights): open_clip's tokenizer for ARCH."""
    import open_clip

    from service.engine.open_clip_family import ClipText

    return ClipText(torch.nn.Identity(), open_clip.get_tokenizer(ARCH))


def unseen_words(rng: random.Random, chars: int, word: int) -> str:
    """``chars`` characters of ``word``-letter words no tokenizer has seen: BPE's dearest text."""
    text = ""
    while len(text) < chars:
        text += "".join(rng.choices(string.ascii_lowercase, k=word)) + " "
    return text[:chars].strip()


TEXTS = ["a cat", "cat " * 74, "cat " * 75, "cat " * 76, "a very long caption " * 25,
         "Ünïcödé naïve café &amp; crème brûlée 🐱🐶", "東京 の 夜景 と 富士山 の 写真 " * 12,
         "!!! ??? ... --- " * 30, "tabs\tand\n\nnewlines   everywhere " * 20, "word " * 1000]


def test_only_the_tokens_that_fit_are_computed_and_they_are_open_clips(clip_text: Any) -> None:
    tokenizer = clip_text._tokenizer
    tokens = clip_text.tokenize(TEXTS)
    assert np.array_equal(tokens.ids, tokenizer(TEXTS).numpy())
    assert tokens.truncated == tuple(len(tokenizer.encode(t)) + 2 > 77 for t in TEXTS)
    assert tokens.truncated[1:4] == (False, False, True)  # 74, 75, 76 tokens between the start and the end token


def test_a_run_of_letters_longer_than_a_word_is_read_to_its_start_and_counts_as_cut(clip_text: Any) -> None:
    from service.engine.open_clip_family import MAX_WORD_CHARS

    t0 = time.perf_counter()
    tokens = clip_text.tokenize(["q" * 2000, "z" * 2000, "cat " + "x" * (MAX_WORD_CHARS + 1)])
    took = time.perf_counter() - t0
    assert tokens.truncated == (True, True, True) and max(tokens.lengths) <= 77
    start = clip_text.tokenize(["q" * MAX_WORD_CHARS])
    assert np.array_equal(tokens.ids[0], start.ids[0]) and start.truncated == (False,)
    assert took < 0.5, f"{took:.2f}s"  # open_clip's own encode took ~0.3 s for each 2,000-letter run


def test_the_largest_label_set_the_limits_allow_tokenizes_well_inside_the_deadline(clip_text: Any) -> None:
    limits = Settings()
    rng = random.Random(3)
    labels = [unseen_words(rng, limits.max_text_chars, rng.randint(3, 64)) for _ in range(limits.max_labels)]
    t0 = time.perf_counter()
    tokens = clip_text.tokenize(labels)
    took = time.perf_counter() - t0
    print(f"\n{len(labels)} labels of {limits.max_text_chars} characters tokenized in {took:.2f}s")
    assert all(tokens.truncated) and took < limits.request_timeout_s / 10, f"{took:.1f}s"


def test_the_tokenizers_word_cache_stays_bounded(clip_text: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine import open_clip_family

    monkeypatch.setattr(open_clip_family, "BPE_CACHE_WORDS", 100)
    clip_text.tokenize([unseen_words(random.Random(i), 60, 8) for i in range(50)])  # ~350 words it has not seen
    assert 2 <= len(clip_text._tokenizer.cache) <= 100
    assert clip_text.tokenize(["<start_of_text> a cat"]).lengths == (5,)  # the special tokens are still known


def test_random_weights_are_seeded_alike_in_every_worker() -> None:
    from service.engine import open_clip_family  # here, not at the top: open_clip's import costs every collection

    a = open_clip_family._random(ARCH).state_dict()
    b = open_clip_family._random(ARCH).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in ("visual.conv1.weight", "token_embedding.weight"))


def test_a_pretrained_tag_resolves_from_the_local_cache_only(tmp_path: Path) -> None:
    from service.engine import open_clip_family

    repo = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    snapshot = tmp_path / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (tmp_path / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    assert open_clip_family.cached_pretrained("ViT-B-32", "laion2b_s34b_b79k", cache_dir=str(tmp_path)) is None
    (snapshot / "open_clip_model.safetensors").write_bytes(b"weights")
    found = open_clip_family.cached_pretrained("ViT-B-32", "laion2b_s34b_b79k", cache_dir=str(tmp_path))
    assert found == str(snapshot / "open_clip_model.safetensors")


def test_unknown_and_uncached_tags_say_what_to_run() -> None:
    with pytest.raises(ModelLoadError, match="laion2b_s34b_b79k"):
        load_model("open_clip:ViT-B-32", "no_such_tag")
    with pytest.raises(ModelLoadError, match="greenserve download-weights open_clip:ViT-B-32 --pretrained openai"):
        load_model("open_clip:ViT-B-32", "openai")
    with pytest.raises(ModelLoadError, match="not an open_clip architecture"):
        load_model("open_clip:ViT-Nope", "random")


def test_settings_take_a_tag_only_for_open_clip_models() -> None:
    assert Settings(model="open_clip:ViT-B-32", weights="laion2b_s34b_b79k").weights == "laion2b_s34b_b79k"
    with pytest.raises(SettingsError, match="pretrained tag"):
        Settings(model="resnet50", weights="laion2b_s34b_b79k")


def test_an_immich_name_carries_its_weights_and_cleans_texts_as_immich() -> None:
    from service.engine.open_clip_family import immich_clean, immich_split

    assert immich_split("XLM-Roberta-Base-ViT-B-32__laion5b_s13b_b90k") == ("xlm-roberta-base-ViT-B-32",
                                                                           "laion5b_s13b_b90k")
    assert immich_split("ViT-B-32") is None
    with pytest.raises(ModelLoadError, match="names its weights"):
        load_model("open_clip:ViT-B-32__openai", "laion2b_s34b_b79k")
    # no ftfy, no HTML unescaping: the quotes, the entity and the ligature stay; accents composed
    assert immich_clean("  My dog’s\t“toy” &amp; ﬁsh cafe\u0301 ") == "my dog’s “toy” &amp; ﬁsh caf\u00e9"
    assert immich_clean("ΟΔΟΣ") == "οδοσ"  # a character at a time, as Hugging Face: not str.lower's final ς
