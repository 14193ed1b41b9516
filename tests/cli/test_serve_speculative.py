"""`tokenmill serve --speculative-config JSON` parses into a SpeculativeConfig; bad ones exit."""

from __future__ import annotations

import pytest

from tokenmill.cli.main import build_parser
from tokenmill.engine.spec_decode.config import SpeculativeConfig


def test_default_is_off_and_json_parses() -> None:
    assert build_parser().parse_args(["serve"]).speculative_config is None
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "draft", "model": "self", "num_layers": 6, "num_speculative_tokens": 2}']
    )
    assert args.speculative_config == SpeculativeConfig("draft", 2, model="self", num_layers=6)


@pytest.mark.parametrize(
    "text,message",
    [("{", "not valid JSON"), ('{"method": "x"}', "method must be one of"), ('{"method": "ngram", "k": 2}', "unknown speculative config keys: k")],
)
def test_bad_configs_exit_with_the_reason(text, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--speculative-config", text])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
