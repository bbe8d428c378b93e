"""Offline first: a model id that is not on the machine fails at once (no connection is even tried),
with one ``error:`` line that says how to provide the model; downloads only when the user opts in."""

from __future__ import annotations

import os
import socket

import huggingface_hub.constants
import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.models.offline import ALLOW_DOWNLOADS, resolve_offline


@pytest.fixture
def clean_env(monkeypatch):
    """Offline settings as a fresh shell has them; restored afterwards."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", ALLOW_DOWNLOADS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return monkeypatch


def test_a_missing_model_fails_at_once_without_network(clean_env, tmp_path):
    attempts: list[object] = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError("network is off in this test")

    clean_env.setattr(socket.socket, "connect", refuse)
    clean_env.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--model", "nobody-org/no-such-model", "--prompt", "hi"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nobody-org/no-such-model" in lines[0]
    assert f"{ALLOW_DOWNLOADS}=1" in lines[0] and "local model directory" in lines[0]
    assert attempts == []  # resolved offline: no connection tried, so nothing to wait for
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True


def test_downloads_only_when_the_user_opts_in(clean_env):
    clean_env.setenv(ALLOW_DOWNLOADS, "1")
    resolve_offline()
    assert "HF_HUB_OFFLINE" not in os.environ and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_an_explicit_hf_setting_is_respected(clean_env):
    clean_env.setenv("HF_HUB_OFFLINE", "0")
    resolve_offline()
    assert os.environ["HF_HUB_OFFLINE"] == "0" and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_the_python_api_resolves_offline_too(clean_env):
    from sparseety.errors import ModelLoadError
    from sparseety.models import load_model

    attempts: list[object] = []
    clean_env.setattr(socket.socket, "connect", lambda self, address: attempts.append(address) or (_ for _ in ()).throw(
        OSError("network is off in this test")))
    with pytest.raises(ModelLoadError, match=f"{ALLOW_DOWNLOADS}=1"):
        load_model("nobody-org/no-such-model")
    assert attempts == [] and "HF_HUB_OFFLINE" not in os.environ  # local_files_only: no connection, no global switch
