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
    assert f"model folder {tmp_path} has no config.json" in capsys.readouterr().err
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


def test_a_fatal_setting_is_the_termination_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(log))
    missing = tmp_path / "models" / "missing"
    assert cli.run(parse("--model", str(missing))) == 2
    message = (
        f"model folder {missing} does not exist: put the model there, or point spec.model"
        " (image.path, pvc.path) or --model at a folder with config.json"
    )
    assert capsys.readouterr().err == f"phasefleet worker: {message}\n"
    assert log.read_text() == message + "\n"


@pytest.mark.parametrize(
    "exc",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:124] err == 0. DefaultCPUAllocator: can't allocate"
            " memory: you tried to allocate 32768000000 bytes. Error code 12"
        ),
        type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate"),
    ],
)
def test_out_of_memory_says_what_to_lower(exc: BaseException) -> None:
    message = cli.engine_failure("/models/m", exc, loaded=False)
    assert message.startswith("out of memory loading model /models/m (")
    assert "lower --num-kv-blocks, maxModelLen or maxNumSeqs" in message
    assert "split the model over more GPUs (tensorParallelSize; an FP8 checkpoint" in message


def test_other_engine_failures_name_the_model_and_the_cause() -> None:
    exc = ValueError("header too large")
    assert cli.engine_failure("/models/m", exc, loaded=False) == (
        "the engine could not load model /models/m (ValueError: header too large): check that"
        " the folder holds a complete Hugging Face model (config.json, tokenizer,"
        " *.safetensors) and spec.model"
    )
    assert cli.engine_failure("/models/m", RuntimeError("CUDA error"), loaded=True) == (
        "the engine failed while serving model /models/m (RuntimeError: CUDA error);"
        " see the pod's log"
    )


def test_a_degree_that_cannot_split_the_model_says_to_change_it() -> None:
    exc = ValueError("tensor_parallel_size 8 must divide the model's 4 attention heads")
    message = cli.engine_failure("/models/m", exc, loaded=False)
    assert message.startswith("model /models/m cannot be split as asked (ValueError: ")
    assert "set tensorParallelSize (--tensor-parallel-size) to a divisor" in message
