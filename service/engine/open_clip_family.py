"""open_clip models (CLIP, SigLIP, ...): an image tower and a text tower that embed into one space.

Weights are never downloaded here: ``random`` (seeded, so every worker serves the same model), a local
file (open_clip's own checkpoint or a ``torch.save(model.state_dict())``), or a pretrained tag found in
the local cache (``greenserve download-weights open_clip:ARCH --pretrained TAG`` fills it). A file is
mapped, not read: the model is built on the meta device and adopts the mapped tensors, so the workers
share one copy from the page cache.
"""

from __future__ import annotations

import logging
import os
import unicodedata
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import open_clip
import regex
import torch
from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME
from open_clip.tokenizer import SimpleTokenizer
from torch import nn

from service.engine.model import LoadedModel
from service.engine.types import ModelInfo, ModelLoadError, Tokens, Transform
from service.engine.weights import RANDOM_SEED, adopt, check_all_set, load_state_dict

log = logging.getLogger(__name__)

TASKS = ("embeddings", "classify", "rank")
# open_clip's BPE costs O(w²) in a word's length w (a 64-letter run 0.36 ms, 256 letters 12.5 ms, a 2,000-letter
# label ~0.3 s), and it caches every word it has seen for ever. No word of a language is this long; a longer run
# of letters or of punctuation (a hash, base64) is read to its first MAX_WORD_CHARS characters, and its text
# counts as truncated. The cache is emptied past BPE_CACHE_WORDS (docs/SIZING.md, Texts).
MAX_WORD_CHARS = 64
BPE_CACHE_WORDS = 100_000
# immich names an open_clip model ARCH__TAG (ViT-B-32__openai, ViT-B-32__laion2b-s34b-b79k). A model served under
# such a name is served the immich way, so that its vectors are an immich library's (docs/MODELS.md, immich): the
# reference's resize and crop (``Transform.exact``), and texts read as immich's Hugging Face tokenizer reads them
# (``immich_clean``, ``IMMICH_WORDS``) instead of through open_clip's ftfy and HTML unescaping.
IMMICH_SEPARATOR = "__"
# the Hugging Face CLIP tokenizer's word split: open_clip's, less its special tokens (immich's text is lower case)
IMMICH_WORDS = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""")


def architectures() -> list[str]:
    return list(open_clip.list_models())


def pretrained_tags(arch: str) -> list[str]:
    return list(open_clip.list_pretrained_tags_by_model(arch))


def immich_split(name: str) -> tuple[str, str] | None:
    """An immich name's (architecture as open_clip spells it, pretrained tag); None for a plain architecture.
    immich capitalises a few architectures its own way (XLM-Roberta-Base-ViT-B-32)."""
    arch, sep, tag = name.partition(IMMICH_SEPARATOR)
    if not sep or not arch or not tag:
        return None
    return next((a for a in architectures() if a.lower() == arch.lower()), arch), tag


def immich_clean(text: str) -> str:
    """A text as immich's tokenizer reads it: runs of whitespace one space (immich's ``clean_text``), then the
    Hugging Face CLIP tokenizer's normalizer (NFC, lower case). open_clip's own also fixes text with ftfy (curly
    quotes straightened, ligatures and full-width letters unfolded) and unescapes HTML (&amp;): other tokens.
    Lower case a character at a time, as the Hugging Face normalizer does: ``str.lower`` writes a word-final
    capital sigma as the final form (ς), Hugging Face as σ, another token."""
    return "".join(c.lower() for c in unicodedata.normalize("NFC", " ".join(text.split())))


class ImageTower(nn.Module):
    """``forward(pixels) -> image embeddings`` (not normalised: the response normalises)."""

    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        self.clip: Any = clip  # open_clip's CLIP or CustomTextCLIP (untyped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.clip.encode_image(x))


class ClipText:
    """The text tower: open_clip's tokenizer (its vocabulary ships in the wheel) and ``encode_text``."""

    def __init__(self, clip: nn.Module, tokenizer: Any, *, immich: bool = False) -> None:
        self._clip: Any = clip  # open_clip's CLIP or CustomTextCLIP (untyped)
        self._tokenizer = tokenizer
        # how a text is cleaned and split into words before BPE: open_clip's, or immich's (``IMMICH_SEPARATOR``)
        self._clean = immich_clean if immich else tokenizer.clean_fn
        self._words: Any = IMMICH_WORDS if immich else getattr(tokenizer, "pat", None)  # None: not BPE (unused)
        self.context_length = int(tokenizer.context_length)
        # CLIP's text transformer is causal and pools at the end token: a token never sees the padding
        # after it, so a batch can run at its longest text's length instead of the context length (a
        # 7-token query costs 1/11 of a 77-token forward), with the same result
        self._trim = (isinstance(clip, open_clip.CLIP) and getattr(clip, "attn_mask", None) is not None
                      and clip.text_pool_type == "argmax")

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        """Truncates past the context length, keeping the end token (as open_clip does); says which did."""
        tok = self._tokenizer
        if not isinstance(tok, SimpleTokenizer) or tok.reduction_fn is not None:
            ids = tok(list(texts)).numpy()
            lengths = tuple(int(n) for n in (ids != 0).sum(axis=1))
            return Tokens(ids, lengths, tuple(False for _ in texts))
        n = self.context_length
        ids = np.zeros((len(texts), n), dtype=np.int64)
        kept: list[int] = []
        cut: list[bool] = []
        for i, text in enumerate(texts):
            body, more = self._first_tokens(text, n - 2)
            row = [tok.sot_token_id, *body, tok.eot_token_id]
            ids[i, :len(row)] = row
            kept.append(len(row))
            cut.append(more)
        if len(tok.cache) > BPE_CACHE_WORDS:  # open_clip keeps every word's BPE for ever: a memory leak
            tok.cache = {tok.decoder[i]: tok.decoder[i] for i in tok.all_special_ids}
        return Tokens(ids, tuple(kept), tuple(cut))

    def _first_tokens(self, text: str, room: int) -> tuple[list[int], bool]:
        """open_clip's ``encode(text)[:room]``, and whether the text has more tokens than that: only the words
        that fill ``room`` go through BPE, and a word longer than ``MAX_WORD_CHARS`` is read to that length
        (the text then counts as cut). The whole text is cleaned and split (linear, in C)."""
        tok = self._tokenizer
        out: list[int] = []
        long_word = False
        for match in self._words.finditer(self._clean(text)):
            if len(out) >= room:  # one more word: at least one more token
                return out[:room], True
            word = match.group()
            long_word |= len(word) > MAX_WORD_CHARS
            word = "".join(tok.byte_encoder[b] for b in word[:MAX_WORD_CHARS].encode("utf-8"))
            out.extend(tok.encoder[piece] for piece in tok.bpe(word).split(" "))
        return out[:room], len(out) > room or long_word

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._trim:
            return cast(torch.Tensor, self._clip.encode_text(ids))
        clip = self._clip
        n = int((ids != 0).sum(dim=1).max())
        ids = ids[:, :n]
        dtype = clip.transformer.get_cast_dtype()
        x = clip.token_embedding(ids).to(dtype) + clip.positional_embedding[:n].to(dtype)
        x = clip.ln_final(clip.transformer(x, attn_mask=clip.attn_mask[:n, :n]))
        x = x[torch.arange(x.shape[0], device=x.device), ids.argmax(dim=-1)]  # the end token's features
        proj = clip.text_projection
        out = x if proj is None else proj(x) if isinstance(proj, nn.Linear) else x @ proj
        return cast(torch.Tensor, out)


def load(name: str, weights: str, *, device: torch.device) -> LoadedModel:
    """``name``: an architecture (ViT-B-32), or immich's name of one with its weights (ViT-B-32__openai), served
    the immich way (``IMMICH_SEPARATOR``)."""
    immich = immich_split(name)
    arch, weights = (immich[0], _immich_weights(name, *immich, weights)) if immich else (name, weights)
    if arch not in architectures():
        raise ModelLoadError(f"GREENSERVE_MODEL=open_clip:{name} is not an open_clip architecture; try "
                             "ViT-B-32, ViT-B-16, ViT-L-14, ViT-B-16-SigLIP, or immich's ViT-B-32__openai "
                             "(`greenserve models`)")
    built, source, tag_cfg = _build(arch, weights)
    if immich and not tag_cfg:  # weights from a file, or random: the preprocessing is still the tag's
        tag_cfg = dict(open_clip.get_pretrained_cfg(arch, immich[1]))
    clip: Any = built.eval().to(device)
    transform = _transform(open_clip.get_model_preprocess_cfg(clip), tag_cfg, exact=immich is not None)
    text = ClipText(clip, open_clip.get_tokenizer(arch), immich=immich is not None)
    scale = float(clip.logit_scale.detach().exp()) if getattr(clip, "logit_scale", None) is not None else 100.0
    bias = float(clip.logit_bias.detach()) if getattr(clip, "logit_bias", None) is not None else 0.0
    info = ModelInfo(f"open_clip:{name}", TASKS, None, (), str(device), "float32", source, transform, format="open_clip",
                     family="open_clip", towers=("image", "text"), context_length=text.context_length,
                     logit_scale=scale, logit_bias=bias)
    # channels_last does nothing for a ViT (one patchifying conv, then matmuls): measured in BENCHMARKS
    return LoadedModel(info=info, module=ImageTower(clip), device=device, channels_last=False,
                       text=text, features_only=True, tower_roots=tower_roots(clip))


def tower_roots(clip: nn.Module) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """What each tower casts for "cast once": the image tower is ``visual``; the text tower is the rest, less
    the logit scale and bias (scalars read once into ``ModelInfo``, kept float32)."""
    return {"image": (clip.get_submodule("visual"), ()), "text": (clip, ("visual.", "logit_scale", "logit_bias"))}


def _immich_weights(name: str, arch: str, tag: str, weights: str) -> str:
    """The weights of an immich-named model: its tag (``auto``), or a file or random ones in its place."""
    if weights in ("auto", "random") or os.path.isfile(weights):
        return tag if weights == "auto" else weights
    if weights.lower().replace("-", "_") == tag.lower().replace("-", "_"):  # open_clip's spelling of a tag
        return tag
    raise ModelLoadError(f"open_clip:{name} names its weights ({tag}), GREENSERVE_WEIGHTS={weights!r} others: leave "
                         f"it auto, give a file or random, or serve open_clip:{arch}{IMMICH_SEPARATOR}{weights}")


def _build(arch: str, weights: str) -> tuple[nn.Module, str, dict[str, Any]]:
    """(the model with its weights, where they came from, the pretrained tag's config if any)."""
    if weights == "auto":
        found = next(((t, p) for t in pretrained_tags(arch) if (p := cached_pretrained(arch, t))), None)
        if found is None:
            log.warning("NO PRETRAINED WEIGHTS for open_clip:%s in the local cache: serving RANDOM weights "
                        "(outputs are meaningless). Run `greenserve download-weights open_clip:%s --pretrained "
                        "TAG` or set GREENSERVE_WEIGHTS.", arch, arch)
            return _random(arch), "random", {}
        tag, path = found
        return _from_tag(arch, tag, path)
    if weights == "random":
        log.warning("GREENSERVE_WEIGHTS=random: open_clip:%s serves random weights (outputs are meaningless)", arch)
        return _random(arch), "random", {}
    if weights == "imagenet":
        raise ModelLoadError("GREENSERVE_WEIGHTS=imagenet is for torchvision models; for open_clip give a "
                             f"pretrained tag ({', '.join(pretrained_tags(arch)[:4])} ...), random or a file")
    if os.path.isfile(weights):
        return _from_file(arch, weights, {}), weights, {}
    return _from_tag(arch, weights, None)


def _from_tag(arch: str, tag: str, path: str | None) -> tuple[nn.Module, str, dict[str, Any]]:
    """A pretrained tag's weights from the local cache (``path`` when already looked up)."""
    tag_cfg = _tag_config(arch, tag)
    path = path or cached_pretrained(arch, tag)
    if path is None:
        raise ModelLoadError(f"open_clip:{arch} pretrained {tag!r} is not in the local cache; run "
                             f"`greenserve download-weights open_clip:{arch} --pretrained {tag}` on a machine "
                             "with internet and copy the cache over (docs/MODELS.md: offline weights)")
    return _from_file(arch, path, tag_cfg), tag, tag_cfg


class _QuietCreate(logging.Filter):
    """open_clip logs "No pretrained weights loaded ... initialized randomly" on the root logger whenever it
    builds without a tag, also when the weights come next from a file; our own log says where they came from."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded")


def _create(arch: str, **kwargs: Any) -> nn.Module:
    quiet = _QuietCreate()
    logging.getLogger().addFilter(quiet)
    try:
        return cast(nn.Module, open_clip.create_model(arch, pretrained=None, load_weights=False, **kwargs))
    finally:
        logging.getLogger().removeFilter(quiet)


def _random(arch: str) -> nn.Module:
    torch.manual_seed(RANDOM_SEED)
    return _create(arch)


def _from_file(arch: str, path: str, tag_cfg: dict[str, Any]) -> nn.Module:
    """Build on the meta device and adopt the file's (mmapped) tensors: no second copy of the weights."""
    clip: Any = _create(arch, device="meta", force_quick_gelu=bool(tag_cfg.get("quick_gelu", False)))
    state = load_state_dict(path)
    if "logit_scale" in state and state["logit_scale"].ndim != clip.logit_scale.ndim:
        state["logit_scale"] = state["logit_scale"].reshape(clip.logit_scale.shape)
    adopt(clip, state, f"open_clip:{arch}", "; check GREENSERVE_MODEL names the architecture the file was saved from")
    for name, buf in list(clip.named_buffers()):
        if buf.is_meta and name.endswith("attn_mask"):  # not saved (persistent=False): the causal mask
            owner = clip.get_submodule(name.rpartition(".")[0]) if "." in name else clip
            mask = torch.full(tuple(buf.shape), float("-inf")).triu_(1)
            owner.register_buffer(name.rpartition(".")[2], mask, persistent=False)
    check_all_set(clip, f"open_clip:{arch}")
    return cast(nn.Module, clip)


def _tag_config(arch: str, tag: str) -> dict[str, Any]:
    cfg = open_clip.get_pretrained_cfg(arch, tag)
    if not cfg:
        raise ModelLoadError(f"GREENSERVE_WEIGHTS={tag!r} is neither random, a file nor a pretrained tag of "
                             f"open_clip:{arch} ({', '.join(pretrained_tags(arch)) or 'it has none'})")
    return dict(cfg)


def cached_pretrained(arch: str, tag: str, cache_dir: str | None = None) -> str | None:
    """The local file of ``arch``'s pretrained ``tag`` (the Hugging Face cache, or open_clip's URL cache);
    ``cache_dir`` overrides the Hugging Face cache's place (``HF_HUB_CACHE``)."""
    cfg = open_clip.get_pretrained_cfg(arch, tag)
    hub = cfg.get("hf_hub", "")
    if hub:
        from huggingface_hub import try_to_load_from_cache

        repo, filename = os.path.split(hub)  # "org/model/" names the repository's default file
        stem, ext = os.path.splitext(filename)
        names = [f"{stem}.safetensors", filename] if ext in (".bin", ".pth") else [filename]
        names = names if filename else [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME]  # open_clip prefers safetensors
        for candidate in names:
            found = try_to_load_from_cache(repo, candidate, cache_dir=cache_dir)
            if isinstance(found, str):
                return found
    url = cfg.get("url", "")
    if url:
        path = os.path.join(os.path.expanduser("~/.cache/clip"), os.path.basename(url))
        if os.path.isfile(path):
            return path
    return None


def download(arch: str, tag: str) -> str:
    """Fill the local cache with ``arch``'s pretrained ``tag`` (needs internet); returns the file."""
    path = open_clip.download_pretrained(_tag_config(arch, tag))
    if not path:
        raise ModelLoadError(f"open_clip has no download for open_clip:{arch} {tag!r}")
    return str(path)


def _transform(pp: dict[str, Any], tag_cfg: dict[str, Any], *, exact: bool = False) -> Transform:
    pp = {**pp, **{k: v for k, v in tag_cfg.items() if k in ("mean", "std", "interpolation", "resize_mode")}}
    size = pp["size"]
    side = int(size if isinstance(size, int) else size[0])
    mode = pp.get("resize_mode", "shortest")
    if mode not in ("shortest", "squash"):
        raise ModelLoadError(f"open_clip resize_mode {mode!r} is not served (only shortest and squash)")
    return Transform(resize_size=side, crop_size=side, mean=tuple(pp["mean"]), std=tuple(pp["std"]),
                     interpolation=pp.get("interpolation", "bicubic"), resize_mode=mode, exact=exact)
