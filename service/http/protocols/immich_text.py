"""A search query as immich's ML service prepares it before tokenizing, so that the same query reaches greenserve's
tokenizer as the same string (immich: ``machine-learning/immich_ml/models/clip/textual.py``, ``clean_text`` in
``models/transforms.py``, the language table in ``models/constants.py``):

    every model       runs of whitespace (``str.split``'s) become one space, and the ends go
    canonicalizing    ASCII punctuation removed, then lower case: the models whose open_clip config says
                      ``text_cfg.tokenizer_kwargs.clean == "canonicalize"`` (the SigLIP family), as immich reads it
    nllb-clip-*       with ``options.language`` (immich's UI locale, a Weblate code): its FLORES-200 code glued in
                      front (``deu_Latn`` + text, no space); a locale immich does not map gets ``eng_Latn``

Truncation is the tokenizer's: the first tokens that fit the model's context, its end token kept (immich's
Hugging Face tokenizer truncates to ``context_length`` that way, and so does ``open_clip_family.ClipText``).
"""

from __future__ import annotations

import functools
import importlib
import string
from dataclasses import dataclass

_PUNCTUATION = str.maketrans("", "", string.punctuation)
DEFAULT_FLORES = "eng_Latn"
# immich's UI locales (Weblate codes) → the FLORES-200 code the NLLB tokenizer knows
FLORES = {
    "af": "afr_Latn", "ar": "arb_Arab", "az": "azj_Latn", "be": "bel_Cyrl", "bg": "bul_Cyrl", "ca": "cat_Latn",
    "cs": "ces_Latn", "da": "dan_Latn", "de": "deu_Latn", "el": "ell_Grek", "en": "eng_Latn", "es": "spa_Latn",
    "et": "est_Latn", "fa": "pes_Arab", "fi": "fin_Latn", "fr": "fra_Latn", "he": "heb_Hebr", "hi": "hin_Deva",
    "hr": "hrv_Latn", "hu": "hun_Latn", "hy": "hye_Armn", "id": "ind_Latn", "it": "ita_Latn", "ja": "jpn_Hira",
    "kmr": "kmr_Latn", "ko": "kor_Hang", "lb": "ltz_Latn", "lt": "lit_Latn", "lv": "lav_Latn", "mfa": "zsm_Latn",
    "mk": "mkd_Cyrl", "mn": "khk_Cyrl", "mr": "mar_Deva", "ms": "zsm_Latn", "nb_NO": "nob_Latn", "nl": "nld_Latn",
    "pl": "pol_Latn", "pt": "por_Latn", "pt_BR": "por_Latn", "ro": "ron_Latn", "ru": "rus_Cyrl", "sk": "slk_Latn",
    "sl": "slv_Latn", "sr_Cyrl": "srp_Cyrl", "sv": "swe_Latn", "ta": "tam_Taml", "te": "tel_Telu", "th": "tha_Thai",
    "tr": "tur_Latn", "uk": "ukr_Cyrl", "vi": "vie_Latn", "zh-CN": "zho_Hans", "zh-TW": "zho_Hant",
    "zh_Hant": "zho_Hant", "zh_SIMPLIFIED": "zho_Hans",
}


@dataclass(frozen=True)
class TextRules:
    """What immich does to a query for one model, besides collapsing whitespace."""

    canonicalize: bool = False
    language_prefix: bool = False  # the multilingual NLLB CLIPs


def rules_for(model: str) -> TextRules:
    """The rules for a served model: a GREENSERVE_MODEL value such as ``open_clip:ViT-B-16-SigLIP``, or immich's
    name of one (``open_clip:ViT-B-16-SigLIP__webli``)."""
    family, _, name = model.partition(":")
    if family != "open_clip":
        return TextRules()
    arch = name.partition("__")[0]
    return TextRules(canonicalize=_canonicalizes(arch), language_prefix=arch.lower().startswith("nllb"))


@functools.lru_cache(maxsize=64)
def _canonicalizes(arch: str) -> bool:
    # open_clip is imported already in a worker that serves one of its models: these are dict lookups
    open_clip = importlib.import_module("open_clip")
    spelled = next((a for a in open_clip.list_models() if a.lower() == arch.lower()), arch)  # immich's capitals
    config = open_clip.get_model_config(spelled) or {}
    kwargs = config.get("text_cfg", {}).get("tokenizer_kwargs") or {}
    return bool(kwargs.get("clean") == "canonicalize")


def prepare(text: str, rules: TextRules, language: str | None = None) -> str:
    """``text`` as immich's ML service hands it to its tokenizer."""
    text = " ".join(text.split())
    if rules.canonicalize:
        text = text.translate(_PUNCTUATION).lower()
    if rules.language_prefix and language is not None:
        text = flores_code(language) + text
    return text


def flores_code(language: str) -> str:
    return FLORES.get(language, DEFAULT_FLORES)
