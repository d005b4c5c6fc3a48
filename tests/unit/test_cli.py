from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
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


def test_open_clip_downloads_name_their_tag() -> None:
    with pytest.raises(SystemExit, match="laion2b_s34b_b79k"):
        cli.main(["download-weights", "open_clip:ViT-B-32"])
    with pytest.raises(SystemExit, match="--pretrained is for open_clip"):
        cli.main(["download-weights", "resnet50", "--pretrained", "openai"])


def test_a_download_without_network_is_one_line_that_says_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    assert cli.main(["download-weights", "resnet18"]) == 1
    [line] = capsys.readouterr().err.splitlines()  # was a 64-line traceback
    assert "could not download the weights of resnet18" in line and "Name or service not known" in line
    assert "on a machine with internet" in line
    assert cli.main(["download-weights", "resnet500"]) == 2
    assert "did you mean resnet50" in capsys.readouterr().err


def test_models_alone_is_an_overview_of_each_family_and_how_to_search(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 15  # was every name of every family: 1,595 lines
    assert all(f"  {family} " in out for family in ("torchvision", "open_clip", "timm"))
    assert "greenserve models 'resnet*'" in out and "open_clip:ViT-B-32" in out


def test_models_lists_the_names_a_pattern_or_a_family_matches(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "RESNET5?"]) == 0  # any case, every family
    assert {"resnet50", "timm:resnet50"} <= set(capsys.readouterr().out.split())
    assert cli.main(["models", "open_clip:vit-b-32*"]) == 0
    listed = capsys.readouterr().out.split()
    assert "open_clip:ViT-B-32" in listed and all(n.startswith("open_clip:") for n in listed)
    assert cli.main(["models", "--family", "torchvision"]) == 0
    listed = capsys.readouterr().out.split()
    assert "resnet50" in listed and not any(":" in n for n in listed)
    assert cli.main(["models", "no-such-model*"]) == 1
    assert "no model matches" in capsys.readouterr().err


def test_settings_checks_the_model_name_against_its_family(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GREENSERVE_MODEL", "resnet500")
    assert cli.main(["settings"]) == 2
    assert "GREENSERVE_MODEL='resnet500'" in (err := capsys.readouterr().err) and "did you mean resnet50" in err
    monkeypatch.setenv("GREENSERVE_MODEL", "open_clip:ViT-B-33")
    assert cli.main(["settings"]) == 2
    assert "did you mean open_clip:ViT-B-32" in capsys.readouterr().err
    monkeypatch.setenv("GREENSERVE_MODEL", "timm:convnext_tiny")
    assert cli.main(["settings"]) == 0
    assert "GREENSERVE_MODEL=timm:convnext_tiny" in capsys.readouterr().out


def test_immichs_names_of_open_clip_models_are_served_names() -> None:
    from service import catalog
    from service.settings_parse import SettingsError

    catalog.check("open_clip:ViT-B-32__openai")
    catalog.check("open_clip:ViT-B-32__laion2b-s34b-b79k")  # immich spells open_clip's tags with hyphens
    catalog.check("open_clip:XLM-Roberta-Base-ViT-B-32__laion5b_s13b_b90k")  # and some architectures its own way
    with pytest.raises(SettingsError, match="ViT-B-32__nope"):
        catalog.check("open_clip:ViT-B-32__nope")
