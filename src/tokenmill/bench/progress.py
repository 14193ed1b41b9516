"""A progress bar on stderr: tqdm when it is installed, else one rewritten plain line."""

from __future__ import annotations

import sys
from typing import Protocol, TextIO


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class PlainProgress:
    """`label: done/total` rewritten in place with a carriage return."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr) -> None:
        self.total, self.label, self.stream = total, label, stream
        self.done = 0
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self) -> None:
        self.stream.write(f"\r{self.label}: {self.done}/{self.total}")
        self.stream.flush()


def make_progress(total: int, label: str, enabled: bool = True) -> Progress:
    if not enabled:
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, label)
    bar: Progress = tqdm(total=total, desc=label, file=sys.stderr, leave=False)
    return bar
