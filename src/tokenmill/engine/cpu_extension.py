"""Builds the engine's C++ CPU kernels (csrc/*.cpp) on first use and imports them.

Each build directory is keyed by a digest of the source, the flags and the CPU, so a
changed source or a different machine sharing $TOKENMILL_HOME gets its own build and an
unchanged one is only re-linked by ninja if at all.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")

logger = logging.getLogger(__name__)


def extension_dir() -> Path:
    """Where JIT-built extensions live: $TOKENMILL_HOME/torch_extensions."""
    home = Path(os.environ.get("TOKENMILL_HOME", "~/.cache/tokenmill")).expanduser()
    return home / "torch_extensions"


def build_extension(source: Path) -> ModuleType:
    """Compile (or reuse) and import one C++ source as a torch extension. Raises on failure."""
    from torch.utils.cpp_extension import load

    stem = source.stem
    digest = hashlib.sha256(
        source.read_bytes() + " ".join(CFLAGS).encode() + _cpu_fingerprint().encode()
    ).hexdigest()[:16]
    build_dir = extension_dir() / f"{stem}_{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a plain file that a killed build leaves behind, after which
    # every later start waits on it forever. Serialize builds with a kernel-held flock
    # instead (released when its holder dies) and clear the stale file under it.
    with open(build_dir / ".tokenmill.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return load(
            name=f"tokenmill_{stem}_{digest}",
            sources=[str(source)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


@functools.cache
def optional_extension(source_name: str) -> ModuleType | None:
    """build_extension(CSRC / source_name), built once per process, or None where it cannot
    be built (logged): its callers then take their torch path."""
    try:
        return build_extension(CSRC / source_name)
    except Exception as exc:  # a build failure means "use torch"
        logger.warning("C++ kernel %s unavailable, using torch: %s", source_name, exc)
        return None


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()
