"""`phasefleet worker` command line: flags, defaults, early refusal of bad settings."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from phasefleet.cli import build_parser
from phasefleet.server import cli


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


def test_flags_and_defaults() -> None:
    args = parse(
        "--model", "/models/m", "--role", "prefill", "--port", "9000", "--dtype", "bfloat16",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--num-kv-blocks", "100",
        "--block-size", "32", "--max-model-len", "1024", "--max-queue-len", "4",
        "--served-model-name", "llama", "--device", "cuda",
    )  # fmt: skip
    expected = {
        "model": "/models/m",
        "role": "prefill",
        "port": 9000,
        "dtype": "bfloat16",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 100,
        "block_size": 32,
        "max_model_len": 1024,
        "max_queue_len": 4,
        "served_model_name": "llama",
        "device": "cuda",
    }
    assert {key: vars(args)[key] for key in expected} == expected
    assert args.run is cli.run
    defaults = parse("--model", "m")
    assert (defaults.role, defaults.port, defaults.host, defaults.dtype) == (
        "both", 8000, "0.0.0.0", "auto",
    )  # fmt: skip
    assert (defaults.max_request_bytes, defaults.stall_timeout) == (16 * 2**20, 120.0)


@pytest.mark.parametrize(
    "argv",
    [["--role", "router"], ["--dtype", "float64"], ["--port", "eighty"]],
)
def test_bad_flags_are_rejected_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("--model", "m", *argv)
    assert exit_info.value.code == 2


def test_bad_settings_exit_2_before_loading_anything(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse("--model", str(tmp_path))) == 2
    assert "model must be a Hugging Face model folder" in capsys.readouterr().err
    assert cli.run(parse("--model", str(tiny_model), "--max-num-seqs", "0")) == 2
    assert "max_num_seqs must be a positive integer" in capsys.readouterr().err
    assert cli.run(parse("--model", str(tiny_model), "--max-queue-len", "0")) == 2
    assert "max_queue_len must be >= 1" in capsys.readouterr().err
    assert cli.run(parse("--model", str(tiny_model), "--max-request-bytes", "0")) == 2
    assert "max_request_bytes must be >= 1" in capsys.readouterr().err
    assert cli.run(parse("--model", str(tiny_model), "--stall-timeout", "-1")) == 2
    assert "stall_timeout must be > 0 seconds" in capsys.readouterr().err


def test_importing_the_cli_does_not_import_torch_or_fastapi() -> None:
    code = (
        "import sys, phasefleet.server.cli; "
        "print(sorted(m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
