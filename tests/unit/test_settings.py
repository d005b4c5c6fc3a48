from __future__ import annotations

import dataclasses
import re

import pytest

from service import settings as settings_mod
from service.settings import SECTIONS, TUNING, Settings, SettingsError, env_name
from service.settings_docs import fields_in, settings_table


def test_defaults_bind_loopback_and_resnet50() -> None:
    s = Settings.from_env({})
    assert s.bind == "127.0.0.1:8000"
    assert s.model == "resnet50"
    assert s.weights == "auto"
    assert s.workers >= 1
    assert (s.dtype, s.cpu_bf16, s.jpeg_decode) == ("auto", "auto", "auto")


def test_a_vit_defaults_to_a_worker_per_two_cores_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_mod, "_cpu_count", lambda: 16)
    clip = Settings.from_env({"GREENSERVE_MODEL": "open_clip:ViT-B-32"})
    assert (clip.workers, clip.torch_threads_per_worker(16)) == (8, 2)
    assert Settings.from_env({"GREENSERVE_MODEL": "resnet50"}).workers == 16  # one per core
    assert Settings.from_env({"GREENSERVE_MODEL": "open_clip:ViT-B-32", "GREENSERVE_WORKERS": "16"}).workers == 16
    monkeypatch.setattr(settings_mod, "_cpu_count", lambda: 1)
    assert Settings.from_env({"GREENSERVE_MODEL": "open_clip:ViT-B-32"}).workers == 1


def test_values_are_cast_from_env() -> None:
    s = Settings.from_env({"GREENSERVE_WORKERS": "3", "GREENSERVE_MAX_BATCH_WAIT_MS": "1.5",
                           "GREENSERVE_CHANNELS_LAST": "false", "GREENSERVE_FETCH_ALLOW": "http://10.0.0.5:9000, 10.1.0.0/16"})
    assert s.workers == 3
    assert s.max_batch_wait_ms == 1.5
    assert s.channels_last is False
    assert s.fetch_allow == ("http://10.0.0.5:9000", "10.1.0.0/16")


@pytest.mark.parametrize("env, needle", [
    ({"GREENSERVE_WORKERS": "two"}, "GREENSERVE_WORKERS"),
    ({"GREENSERVE_WORKERS": "0"}, "GREENSERVE_WORKERS"),
    ({"GREENSERVE_DEVICE": "tpu"}, "GREENSERVE_DEVICE"),
    ({"GREENSERVE_WEIGHTS": "/no/such/file.pt"}, "GREENSERVE_WEIGHTS"),
    ({"GREENSERVE_IMAGE_BASE_URL": "ftp://x/"}, "GREENSERVE_IMAGE_BASE_URL"),
    ({"GREENSERVE_FETCH_ALLOW": "not a cidr"}, "GREENSERVE_FETCH_ALLOW"),
    ({"GREENSERVE_CHANNELS_LAST": "maybe"}, "GREENSERVE_CHANNELS_LAST"),
    ({"GREENSERVE_MAX_IMAGESS": "3"}, "GREENSERVE_MAX_IMAGESS"),
    ({"GREENSERVE_DTYPE": "int8"}, "GREENSERVE_DTYPE"),
    ({"GREENSERVE_CPU_BF16": "maybe"}, "GREENSERVE_CPU_BF16"),
    ({"GREENSERVE_JPEG_DECODE": "gpu"}, "GREENSERVE_JPEG_DECODE"),
])
def test_bad_values_fail_naming_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        Settings.from_env(env)


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(AttributeError):
        s.model = "resnet18"  # type: ignore[misc]


def test_torch_threads_default_to_core_share() -> None:
    assert Settings(workers=2).torch_threads_per_worker(cores=2) == 1
    assert Settings(workers=1).torch_threads_per_worker(cores=8) == 8
    assert Settings(workers=4).torch_threads_per_worker(cores=2) == 1
    assert Settings(workers=2, torch_threads=3).torch_threads_per_worker(cores=2) == 3


def test_base_origin_is_scheme_host_port() -> None:
    assert Settings(image_base_url="http://Cdn.Example.com:9000/album/").base_origin == "http://cdn.example.com:9000"


def test_every_setting_has_a_known_section() -> None:
    fields = dataclasses.fields(Settings)
    assert {f.name: f.metadata["section"] for f in fields if f.metadata["section"] not in SECTIONS} == {}
    assert sum(len(fields_in(section)) for section in SECTIONS) == len(fields)
    assert all(fields_in(section) for section in SECTIONS), "a section with no setting"


def test_an_unknown_section_fails_where_the_setting_is_declared() -> None:
    with pytest.raises(ValueError, match="Networking"):
        settings_mod._setting(1, "a doc", section="Networking")


def test_settings_table_has_a_table_per_section_in_order_and_names_the_tuning_switches() -> None:
    table = settings_table()
    headings = re.findall(r"^### (\w+)$", table, re.M)
    assert headings == list(SECTIONS)  # Tuning last
    for section, body in zip(SECTIONS, re.split(r"^### \w+$", table, flags=re.M)[1:], strict=True):
        rows = re.findall(r"^\| `(GREENSERVE_\w+)` \|", body, re.M)
        if section == TUNING:  # no table of its own here: names, and the link to docs/SIZING.md's table
            assert rows == [] and "docs/SIZING.md#tuning" in body
            assert all(f"`{env_name(f.name)}`" in body for f in fields_in(TUNING))
        else:
            assert rows == [env_name(f.name) for f in fields_in(section)]


def test_the_table_shows_a_default_made_by_a_factory() -> None:
    table = settings_table()
    assert "| `GREENSERVE_CALLER_FROM` | `token,address` |" in table
    assert "| `GREENSERVE_FETCH_ALLOW` | (empty) |" in table
