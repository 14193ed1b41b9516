"""`tokenmill serve` flags parse into the settings the server and engine get."""

from __future__ import annotations

import pytest

from tokenmill.cli.main import build_parser


def test_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.model == "smollm2-135m-instruct"
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("127.0.0.1", 8000, None, None)
    assert (args.dtype, args.max_model_len, args.max_queue_len) == ("auto", None, 512)
    assert args.quantization is None
    assert args.handler.__name__ == "serve_command"


def test_all_flags() -> None:
    args = build_parser().parse_args(
        [
            "serve", "/models/x.gguf", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
            "--served-model-name", "x", "--kv-cache-memory-bytes", "1000000", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--max-model-len", "1024", "--dtype", "float32",
            "--max-queue-len", "4", "--drain-timeout", "5", "--health-stall-timeout", "9",
            "--max-request-body-bytes", "1024", "--no-prefix-caching", "--quantization", "int4",
            "--quantization-group-size", "64",
        ]
    )
    assert args.model == "/models/x.gguf"
    assert (args.host, args.port, args.api_key, args.served_model_name) == ("0.0.0.0", 9000, "k", "x")
    assert (args.kv_cache_memory_bytes, args.max_num_seqs, args.max_num_batched_tokens) == (1000000, 8, 256)
    assert (args.max_model_len, args.dtype, args.max_queue_len) == (1024, "float32", 4)
    assert (args.drain_timeout, args.health_stall_timeout, args.max_request_body_bytes) == (5.0, 9.0, 1024)
    assert args.no_prefix_caching is True
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--max-num-seqs", "0"], ["--max-queue-len", "-1"], ["--dtype", "int3"], ["--quantization", "int3"], ["--quantization-group-size", "48"]])
def test_bad_flags_exit(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize("value", ["auto", "fp8", "int8"])
def test_kv_cache_dtype_flag(value: str) -> None:
    assert build_parser().parse_args(["serve"]).kv_cache_dtype == "auto"
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", value]).kv_cache_dtype == value


@pytest.mark.parametrize("value", ["fp16", "bf16", "int4", "FP8"])
def test_bad_kv_cache_dtype_exits(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", value])
    assert "invalid choice" in capsys.readouterr().err
