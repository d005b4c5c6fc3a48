from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.imagehost import ImageHost
from harness.launch import ROOT
from service import cli
from service.engine.loading import load_model


def test_download_weights_fills_the_cache_that_imagenet_mode_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights_file: Path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with ImageHost({"resnet18.pth": weights_file.read_bytes()}) as mirror:
        # a mirror of a different file: the official SHA-256 prefix cannot match, so skip the check
        path = cli.download_weights("resnet18", url=mirror.url("resnet18.pth"), verify_hash=False)
    assert Path(path).parent == tmp_path / "hub" / "checkpoints"
    assert load_model("resnet18", "imagenet").info.weights == "imagenet"


def test_download_weights_checks_the_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with ImageHost({"bad.pth": b"not the weights"}) as mirror:
        with pytest.raises(RuntimeError, match="invalid hash"):
            cli.download_weights("resnet18", url=mirror.url("bad.pth"))
    assert not list((tmp_path / "hub" / "checkpoints").iterdir())


def test_settings_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["settings", "--markdown"]) == 0
    assert "`GREENSERVE_MODEL`" in capsys.readouterr().out


def test_settings_error_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GREENSERVE_WORKERS", "many")
    assert cli.main(["settings"]) == 2
    assert "GREENSERVE_WORKERS" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_cli_quietly() -> None:
    """``greenserve settings | head``: the reader leaves early (``true`` reads nothing at all)."""
    cli_path = Path(sys.executable).parent / "greenserve"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GREENSERVE_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, wherever the virtualenv's editable install points
    out = subprocess.run(f"{cli_path} settings | true", shell=True, capture_output=True, text=True, env=env,
                         timeout=60)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    head = subprocess.run(f"{cli_path} settings --markdown | head -1", shell=True, capture_output=True, text=True,
                          env=env, timeout=60)
    assert head.stdout.startswith("### Server") and "Traceback" not in head.stderr


def test_open_clip_downloads_name_their_tag_and_models_lists_every_family(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="laion2b_s34b_b79k"):
        cli.main(["download-weights", "open_clip:ViT-B-32"])
    with pytest.raises(SystemExit, match="--pretrained is for open_clip"):
        cli.main(["download-weights", "resnet50", "--pretrained", "openai"])
    assert cli.main(["models"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"resnet50", "open_clip:ViT-B-32"} <= set(listed)
