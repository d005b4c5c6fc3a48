"""immich's machine learning for an open_clip model, as a reference for the parity tests: the model exported the way
immich's model exporter exports it, and immich's preprocessing and tokenisation, written here from reading its code.

    export(clip, directory)     what immich's exporter (machine-learning/export/immich_model_exporter/exporters/onnx/
                                models/openclip.py) writes for an open_clip model: visual/model.onnx (``encode_image``
                                with ``normalize=True``; input "image", float32 (1, 3, S, S)), visual/preprocess_cfg.json
                                (``open_clip.get_model_preprocess_cfg``), textual/model.onnx (``encode_text``, normalised;
                                input "text", int32 (1, context length)), opset 19, TorchScript's exporter, with
                                PyTorch's fused attention path off
    ImmichClip(directory)       what immich_ml/models/clip/visual.py and textual.py do with them: ``crop`` (Pillow
                                decode without EXIF orientation, RGB, the whole image resized so its shorter side is
                                the model's size, the longer truncated to an integer, then cropped at the centre's
                                integer offset; squash resizes to the square), ``image`` (float32 / 255, mean/std,
                                onnxruntime with immich's CPU session options) and ``text`` (whitespace runs to one
                                space, the Hugging Face tokenizer)
    clip_tokenizer()            the Hugging Face CLIP tokenizer immich saves beside its textual model (from
                                openai/clip-vit-base-patch32), rebuilt from the vocabulary open_clip ships, the way
                                transformers converts CLIP's: NFC, whitespace runs, lower case; the word split; bytes;
                                BPE with "</w>"; start and end tokens; padded with the end token to the context length
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

START, END = "<|startoftext|>", "<|endoftext|>"  # the Hugging Face tokenizer's names of open_clip's special tokens
OPSET = 19  # immich_model_exporter/exporters/onnx/__init__.py
WORDS = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""  # transformers' CLIPConverter


def export(clip: Any, directory: Path) -> Path:
    """``clip`` (an open_clip CLIP, eval) exported to ``directory`` as immich's exporter does; returns it."""
    import open_clip

    visual, textual = directory / "visual", directory / "textual"
    visual.mkdir(parents=True, exist_ok=True)
    textual.mkdir(parents=True, exist_ok=True)
    (visual / "preprocess_cfg.json").write_text(json.dumps(open_clip.get_model_preprocess_cfg(clip)))
    size = clip.visual.image_size
    side = size[0] if isinstance(size, (tuple, list)) else size
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        _onnx(_Tower(clip, "image"), torch.randn(1, 3, side, side), "image", visual / "model.onnx")
        ids = torch.ones(1, clip.context_length, dtype=torch.int32)
        _onnx(_Tower(clip, "text"), ids, "text", textual / "model.onnx")
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return directory


def _onnx(module: Any, example: Any, name: str, path: Path) -> None:
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated; immich's ran it under the same filter
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), path.as_posix(), input_names=[name], output_names=["embedding"],
                          opset_version=OPSET, dynamo=False)


class _Tower(torch.nn.Module):
    """One tower's ``encode_*(x, normalize=True)`` as the forward of a module holding the whole model (immich sets
    it as the model's own forward)."""

    def __init__(self, clip: Any, tower: str) -> None:
        super().__init__()
        self.clip, self.tower = clip, tower

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        encode = self.clip.encode_image if self.tower == "image" else self.clip.encode_text
        return encode(x, normalize=True)  # type: ignore[no-any-return]


class ImmichClip:
    """immich's visual and textual encoders of one exported model, run with onnxruntime on the CPU."""

    def __init__(self, directory: Path) -> None:
        import onnxruntime as ort

        self.cfg = json.loads((directory / "visual" / "preprocess_cfg.json").read_text())
        size = self.cfg["size"]
        self.size = int(size[0] if isinstance(size, list) else size)
        self.mean = np.array(self.cfg["mean"], dtype=np.float32)
        self.std = np.array(self.cfg["std"], dtype=np.float32)
        # immich_ml/sessions/ort.py's defaults on a CPU: no memory arena, one inter-op and two intra-op threads
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_cpu_mem_arena = False
        options.inter_op_num_threads, options.intra_op_num_threads = 1, 2
        run, provider = ["CPUExecutionProvider"], [{"arena_extend_strategy": "kSameAsRequested"}]
        self.visual, self.textual = (
            ort.InferenceSession((directory / tower / "model.onnx").as_posix(), options, providers=run,
                                 provider_options=provider) for tower in ("visual", "textual"))
        self.tokenizer = clip_tokenizer(int(self.textual.get_inputs()[0].shape[1]))

    def crop(self, data: bytes) -> np.ndarray:
        """The preview's pixels as the visual model gets them, before normalising: (S, S, 3) uint8."""
        image = Image.open(io.BytesIO(data))
        image.load()
        image = image if image.mode == "RGB" else image.convert("RGB")
        resample = {r.name.lower(): r for r in Image.Resampling}[self.cfg.get("interpolation", "bicubic").lower()]
        if self.cfg.get("resize_mode", "shortest") == "squash":
            return np.asarray(image.resize((self.size, self.size), resample=resample))
        w, h = image.size
        size = (self.size, int(h / w * self.size)) if w < h else (int(w / h * self.size), self.size)
        image = image.resize(size, resample=resample)
        left, top = int(size[0] / 2 - self.size / 2), int(size[1] / 2 - self.size / 2)
        return np.asarray(image.crop((left, top, left + self.size, top + self.size)))

    def image(self, data: bytes) -> np.ndarray:
        """The preview's unit vector."""
        pixels = (self.crop(data).astype(np.float32) / 255.0 - self.mean) / self.std
        return np.asarray(self.visual.run(None, {"image": pixels.transpose(2, 0, 1)[None]})[0][0])

    def tokens(self, text: str) -> np.ndarray:
        return np.array(self.tokenizer.encode(" ".join(text.split())).ids, dtype=np.int32)

    def text(self, text: str) -> np.ndarray:
        """The text's unit vector."""
        return np.asarray(self.textual.run(None, {"text": self.tokens(text)[None]})[0][0])


def clip_tokenizer(context_length: int = 77) -> Any:
    """The Hugging Face CLIP tokenizer (``tokenizers``), padded and truncated as immich's textual encoder sets it."""
    from open_clip.tokenizer import SimpleTokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    simple = SimpleTokenizer()
    names = {"<start_of_text>": START, "<end_of_text>": END}
    vocab = {names.get(token, token): i for token, i in simple.encoder.items()}
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.__getitem__)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=END, continuing_subword_prefix="",
                                     end_of_word_suffix="</w>", fuse_unk=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                 normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(WORDS), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.RobertaProcessing((END, vocab[END]), (START, vocab[START]),  # sep, cls
                                                            trim_offsets=False, add_prefix_space=False)
    tokenizer.add_special_tokens([START, END])
    tokenizer.enable_padding(length=context_length, pad_id=vocab[END], pad_token=END)
    tokenizer.enable_truncation(max_length=context_length)
    return tokenizer
