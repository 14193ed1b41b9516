"""Subprocess entry for test_launcher: the real launcher over a slow FakeEngine.

Usage: python launcher_main.py PORT DRAIN_TIMEOUT_S STEP_DELAY_S. Prints "engine shut down"
(and the aborted request ids) when the launcher shuts the engine down.
"""

from __future__ import annotations

import sys

from fake_engine import FakeEngine

from tokenmill.server.app import build_app
from tokenmill.server.launcher import run
from tokenmill.server.settings import ServerSettings


class ReportingEngine(FakeEngine):
    async def shutdown(self) -> None:
        print(f"engine shut down; aborted={len(self.aborted)} finished={len(self.finished)}", flush=True)


def main() -> int:
    port, drain, delay = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    engine = ReportingEngine(step_delay_s=delay)

    async def load() -> FakeEngine:
        return engine

    app = build_app(None, ServerSettings(served_model_name="fake-model", drain_timeout_s=drain))
    return run(app, "127.0.0.1", port, load_engine=load, drain_timeout_s=drain, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
