"""`tokenmill bench serve` end to end against tokenmill's server over the FakeEngine."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from fake_engine import FakeEngine
from server_harness import ThreadedServer

from tokenmill.cli.main import main
from tokenmill.server.app import build_app
from tokenmill.server.settings import ServerSettings


@pytest.fixture
def server() -> Iterator[ThreadedServer]:
    settings = ServerSettings(served_model_name="fake-model", model="fake/path")
    with ThreadedServer(build_app(FakeEngine(max_model_len=4096), settings)) as s:
        yield s


def bench(server: ThreadedServer, *args: str) -> int:
    return main(["bench", "serve", "--base-url", server.base_url, "--model", "fake-model", "--no-progress", *args])


def test_multi_turn_run_writes_the_report(
    server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = bench(
        server, "--dataset", "multi-turn", "--system-prompt-len", "20", "--num-prompts", "6", "--num-warmups", "1",
        "--output-len", "5", "--ignore-eos", "--concurrency", "3", "--slo", "ttft=60000", "--json", str(out),
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 30
    assert report["goodput"] == pytest.approx(report["request_throughput"])
    assert report["config"]["dataset"] == "multi-turn" and report["config"]["concurrency"] == 3
    printed = capsys.readouterr().out
    assert "closed loop, concurrency 3" in printed
    assert any(line.split() == ["completed", "/", "failed", "6", "/", "0"] for line in printed.splitlines())
    assert f"wrote {out}" in printed


def test_sweep_writes_one_report_per_point_and_a_plot(server: ThreadedServer, tmp_path: Path) -> None:
    sharegpt = tmp_path / "sg.json"
    turns = [{"from": "human", "value": "tell me a story"}, {"from": "gpt", "value": "once"}]
    sharegpt.write_text(json.dumps([{"conversations": turns}] * 8))
    code = bench(
        server, "--dataset", "sharegpt", "--dataset-path", str(sharegpt), "--output-len", "3", "--ignore-eos",
        "--num-prompts", "4", "--num-warmups", "0", "--sweep-concurrency", "1,2",
        "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"),
    )
    assert code == 0
    for label, concurrency in (("c1", 1), ("c2", 2)):
        report = json.loads((tmp_path / f"s_{label}.json").read_text())
        assert report["config"]["concurrency"] == concurrency and report["completed"] == 4
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_open_loop_run(server: ThreadedServer, tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    code = bench(
        server, "--dataset", "multi-turn", "--system-prompt-len", "8", "--num-prompts", "5", "--output-len", "2",
        "--request-rate", "inf", "--burstiness", "0.5", "--json", str(out),
    )
    assert code == 0
    config = json.loads(out.read_text())["config"]
    assert config["request_rate"] == "inf" and config["concurrency"] is None and config["burstiness"] == 0.5


def test_failed_requests_give_exit_status_1(server: ThreadedServer) -> None:
    code = main(
        ["bench", "serve", "--base-url", server.base_url, "--model", "nope", "--no-progress", "--dataset",
         "multi-turn", "--num-prompts", "2", "--num-warmups", "0", "--system-prompt-len", "4"]
    )
    assert code == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--plot", "x.png"], "--plot needs a sweep"),
        (["--slo", "ttft"], "an SLO is ttft=MS"),
        (["--endpoint", "chat", "--num-prompts", "1"], "chat endpoint needs text"),
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--input-len", "9:3"], "low <= high"),
        (["--dataset", "multi-turn", "--output-len", "2:4"], "fixed --output-len"),
        (["--sweep-concurrency", "1", "--sweep-rate", "2"], "not both"),
        (["--sweep-concurrency", "1,2", "--concurrency", "4"], "drop --concurrency"),
        (["--sweep-rate", "1,2", "--request-rate", "4"], "drop --request-rate"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "neither a path nor a model"),
    ],
)
def test_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", "--model", "no-such-model", "--no-progress", *args])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text", ["[1]", "{not json"])
def test_extra_body_must_be_a_json_object(text: str) -> None:
    from tokenmill.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--model", "m", "--extra-body", text])
    args = build_parser().parse_args(["bench", "serve", "--model", "m", "--extra-body", '{"response_format": {"type": "json_object"}}'])
    assert args.extra_body == {"response_format": {"type": "json_object"}}
