"""``greenserve`` command line: what an operator runs besides the server itself.

    greenserve download-weights MODEL   put torchvision's pretrained file into the local torch cache
    greenserve download-weights open_clip:ARCH --pretrained TAG
                                        put an open_clip checkpoint into the local (Hugging Face) cache
    greenserve download-weights timm:NAME   timm's pretrained file, into the same cache
    greenserve settings [--markdown]    every GREENSERVE_* setting with its default (the README's tables)
    greenserve models [PATTERN]         the models each family can serve: an overview, or the names that match
    greenserve export MODEL --out F     a checkpoint already in the serving layout (shared by workers)
    greenserve cache stats|clear        the embedding cache GREENSERVE_CACHE names (disk or redis): its entries
                                        and bytes as JSON, or every entry removed
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from service import catalog
from service.settings import Settings, SettingsError
from service.settings_docs import settings_table

_HASH_RE = re.compile(r"-([a-f0-9]{6,})\.")


def download_weights(name: str, *, url: str | None = None, verify_hash: bool = True) -> str:
    """Fetch ``name``'s default torchvision weights into ``$TORCH_HOME/hub/checkpoints``; returns the path.

    ``url`` may point at an internal mirror of the same file; its SHA-256 prefix (in the official file
    name) is still checked unless ``verify_hash`` is false.
    """
    import torch
    from torchvision.models import get_model_weights

    official = get_model_weights(name).DEFAULT.url
    filename = os.path.basename(official)
    dest_dir = os.path.join(torch.hub.get_dir(), "checkpoints")
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, filename)
    if os.path.isfile(dest):
        return dest
    match = _HASH_RE.search(filename)
    torch.hub.download_url_to_file(url or official, dest, hash_prefix=match.group(1) if match and verify_hash else None,
                                   progress=sys.stderr.isatty())
    return dest


def _download(args: argparse.Namespace) -> str:
    catalog.check(args.model)
    if args.model.startswith("timm:"):
        from service.engine.timm_family import download as download_timm

        return download_timm(args.model.removeprefix("timm:"))
    if not args.model.startswith("open_clip:"):
        if args.pretrained:
            raise SystemExit("--pretrained is for open_clip models; torchvision models have one default file")
        return download_weights(args.model, url=args.url, verify_hash=not args.no_verify_hash)
    from service.engine.open_clip_family import download, immich_split, pretrained_tags

    arch, tag = immich_split(args.model.removeprefix("open_clip:")) or (args.model.removeprefix("open_clip:"), "")
    if not (args.pretrained or tag):  # immich's names carry their weights (ViT-B-32__openai)
        tags = pretrained_tags(arch)
        raise SystemExit(f"name the weights with --pretrained; {args.model} has: {', '.join(tags) or 'none'}")
    return download(arch, args.pretrained or tag)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:  # the reader went away (``greenserve settings | head``): stop quietly
        # Python would flush stdout again at exit and fail the same way; point it at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="greenserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download-weights", help="download pretrained weights into the torch cache")
    dl.add_argument("model", help="torchvision model name (resnet50), open_clip:ARCH (open_clip:ViT-B-32) or timm:NAME")
    dl.add_argument("--pretrained", help="open_clip pretrained tag, e.g. laion2b_s34b_b79k")
    dl.add_argument("--url", help="mirror URL of the same file (default: torchvision's)")
    dl.add_argument("--no-verify-hash", action="store_true", help="skip the SHA-256 prefix check")
    st = sub.add_parser("settings", help="show settings (current values, or the README table)")
    st.add_argument("--markdown", action="store_true", help="print the Markdown table of all settings")
    mo = sub.add_parser("models", help="the models each family (torchvision, open_clip, timm) can serve: an overview, "
                        "or every name matching PATTERN")
    mo.add_argument("pattern", nargs="?", help="shell-style, any case, with or without the family: 'resnet*', "
                    "'open_clip:*L-14*'")
    mo.add_argument("--family", choices=catalog.FAMILIES, help="only this family's names (all of them without PATTERN)")
    ex = sub.add_parser("export", help="write a checkpoint in the serving layout (shared across workers)")
    ex.add_argument("model", help="torchvision model name, e.g. resnet50")
    ex.add_argument("--weights", default="auto", help="auto | imagenet | random | state-dict path")
    ex.add_argument("--out", required=True, help="where to write the checkpoint")
    ex.add_argument("--no-channels-last", action="store_true", help="keep the default memory format")
    ca = sub.add_parser("cache", help="the embedding cache's size, or clear it (GREENSERVE_CACHE, _CACHE_DIR)")
    ca.add_argument("action", choices=("stats", "clear"))
    return parser


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)

    if args.command == "download-weights":
        return _download_weights(args)
    elif args.command == "settings":
        if args.markdown:
            print(settings_table())
        else:
            try:
                settings = Settings.from_env()
                catalog.check(settings.model)  # the server's master checks the name the same way
            except SettingsError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            for key, value in settings.describe().items():
                print(f"GREENSERVE_{key.upper()}={value}")
    elif args.command == "cache":
        return _cache(args.action)
    elif args.command == "export":
        from service.engine.torchvision_family import export_checkpoint

        info = export_checkpoint(args.model, args.weights, args.out, channels_last=not args.no_channels_last)
        print(" ".join(f"{k}={v}" for k, v in info.items()))
    elif args.command == "models":
        return _models(args.pattern, args.family)
    return 0


def _download_weights(args: argparse.Namespace) -> int:
    """One line, not a traceback, when the name is wrong or the file cannot be fetched (offline, say)."""
    from service.engine.types import ModelLoadError

    try:
        print(_download(args))
    except (SettingsError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # no network (URLError), the hub unreachable or without the file
        reason = " ".join(str(exc).split()).split(". ")[0][:200]  # the first sentence: the hub's run on
        print(f"error: could not download the weights of {args.model} ({reason}); run this on a machine with "
              "internet and copy its cache here (docs/MODELS.md#real-weights)", file=sys.stderr)
        return 1
    return 0


def _models(pattern: str | None, family: str | None) -> int:
    if pattern is None and family is None:
        print(catalog.overview())
        return 0
    families = (family,) if family else catalog.FAMILIES
    found = catalog.matching(pattern or "*", families)
    print("\n".join(found))
    if not found:
        print(f"no model matches {pattern!r}; `greenserve models` shows a few of each family", file=sys.stderr)
        return 1
    return 0


def _cache(action: str) -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from service.cache.tiers import shared_store

    store = shared_store(settings)
    if store is None:
        print(f"GREENSERVE_CACHE={settings.cache}: no cache outside the workers' memory (see "
              "greenserve_cache_memory_bytes on /metrics)", file=sys.stderr)
        return 1
    if action == "stats":
        print(json.dumps(store.stats(), indent=2))
    else:
        print(json.dumps({"store": store.name, "removed": store.clear()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
