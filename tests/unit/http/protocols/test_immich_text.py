"""A query as immich's ML service prepares it (clean_text, SigLIP's canonicalisation, NLLB's language code), and
the tokens greenserve's tokenizer then makes of it: immich's rules, as tables of inputs and what immich produces."""

from __future__ import annotations

import pytest

from service.http.protocols import immich_text
from service.http.protocols.immich_text import TextRules, prepare

CLIP = TextRules()
SIGLIP = TextRules(canonicalize=True)
NLLB = TextRules(language_prefix=True)


@pytest.mark.parametrize(("text", "rules", "language", "expected"), [
    # every model: str.split's whitespace (tabs, newlines, no-break spaces) to one space, the ends stripped
    ("  a photo\n of a\t\tcat ", CLIP, None, "a photo of a cat"),
    ("a\u00a0dog\u3000on a beach", CLIP, None, "a dog on a beach"),
    ("Don't STOP: 3.5 * 2!", CLIP, "de", "Don't STOP: 3.5 * 2!"),  # case and punctuation are the tokenizer's
    ("", CLIP, None, ""),
    ("   ", CLIP, None, ""),
    # SigLIP: ASCII punctuation removed after the whitespace is collapsed (so a lone "-" leaves two spaces),
    # then lower case; "_" is punctuation to Python (open_clip's own canonicalisation makes it a space)
    ("A Dog's  Day-Trip!", SIGLIP, None, "a dogs daytrip"),
    ("cat - dog", SIGLIP, None, "cat  dog"),
    ("snake_case & <b>HTML</b>", SIGLIP, None, "snakecase  bhtmlb"),
    ("Ünïcödé “quotes” ¿qué?", SIGLIP, None, "ünïcödé “quotes” ¿qué"),  # only ASCII punctuation goes
    # NLLB: the locale's FLORES-200 code glued in front, after cleaning; no language: no code
    ("ein Hund  am Strand", NLLB, "de", "deu_Latnein Hund am Strand"),
    ("un chien", NLLB, "fr", "fra_Latnun chien"),
    ("狗", NLLB, "zh-CN", "zho_Hans狗"),
    ("cão", NLLB, "pt_BR", "por_Latncão"),
    ("a dog", NLLB, "xx", "eng_Latna dog"),  # a locale immich does not map: English, as immich falls back
    ("a dog", NLLB, "", "eng_Latna dog"),
    ("a dog", NLLB, None, "a dog"),
    ("a dog", CLIP, "de", "a dog"),  # a language is NLLB's only
])
def test_a_query_is_prepared_as_immich_prepares_it(text: str, rules: TextRules, language: str | None,
                                                   expected: str) -> None:
    assert prepare(text, rules, language) == expected


@pytest.mark.parametrize(("model", "rules"), [
    ("open_clip:ViT-B-32", CLIP),
    ("open_clip:ViT-B-16-SigLIP", SIGLIP),
    ("open_clip:ViT-SO400M-14-SigLIP2-378", SIGLIP),
    ("open_clip:ViT-B-16-SigLIP-i18n-256", SIGLIP),
    ("open_clip:nllb-clip-base-siglip", NLLB),  # no canonicalisation: its config sets no clean function
    ("open_clip:xlm-roberta-base-ViT-B-32", CLIP),
    ("open_clip:ViT-B-16-SigLIP__webli", SIGLIP),  # immich's name, served the immich way
    ("open_clip:NLLB-clip-base-siglip__v1", NLLB),
    ("resnet50", CLIP),
])
def test_the_rules_follow_the_models_open_clip_config_as_immich_reads_it(model: str, rules: TextRules) -> None:
    assert immich_text.rules_for(model) == rules


def test_every_locale_maps_to_a_flores_code() -> None:
    assert len(immich_text.FLORES) == 55
    assert all(len(code) == 8 and code[3] == "_" for code in immich_text.FLORES.values())


# ---------------------------------------------------------------------- the tokens greenserve makes of them


@pytest.fixture(scope="module")
def clip_text():  # type: ignore[no-untyped-def]
    """greenserve's CLIP text tokenizer alone (no weights), as the engine builds it for the test CLIP."""
    open_clip = pytest.importorskip("open_clip")
    torch = pytest.importorskip("torch")
    from service.engine.open_clip_family import ClipText

    return ClipText(torch.nn.Identity(), open_clip.get_tokenizer("ViT-S-32-alt"))


@pytest.mark.parametrize(("text", "words"), [
    ("  A photo\n of a   CAT ", ["a</w>", "photo</w>", "of</w>", "a</w>", "cat</w>"]),
    ("dog,beach", ["dog</w>", ",</w>", "beach</w>"]),
])
def test_a_prepared_query_becomes_the_tokens_immich_makes(clip_text, text: str, words: list[str]) -> None:  # type: ignore[no-untyped-def]
    """The CLIP tokenizer immich ships (Hugging Face's, for openai/clip-vit-base-patch32) lower-cases and reads
    CLIP's byte-level BPE, as open_clip's does: start, the words' pieces, end, zeros."""
    tok = clip_text._tokenizer
    tokens = clip_text.tokenize([prepare(text, CLIP)])
    expected = [tok.sot_token_id, *(tok.encoder[w] for w in words), tok.eot_token_id]
    assert tokens.ids[0, :len(expected)].tolist() == expected and not tokens.ids[0, len(expected):].any()


def test_a_long_query_keeps_its_first_75_tokens_and_the_end_token(clip_text) -> None:  # type: ignore[no-untyped-def]
    """immich truncates to the context (77) with its tokenizer's template: start, the first 75, end."""
    tok = clip_text._tokenizer
    text = prepare(" ".join(f"word{i}" for i in range(200)), CLIP)
    tokens = clip_text.tokenize([text])
    assert tokens.ids[0].tolist() == [tok.sot_token_id, *tok.encode(text)[:75], tok.eot_token_id]
    assert tokens.truncated == (True,)
