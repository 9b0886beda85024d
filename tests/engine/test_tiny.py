"""make-tiny writes folders that transformers and our engine both load."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from phasefleet.engine import tiny
from phasefleet.engine.tiny import make_tiny


def test_module_does_not_import_torch() -> None:
    code = "import sys, phasefleet.engine.tiny; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_cli_writes_a_model_with_the_given_sizes(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    tiny.add_arguments(parser)
    args = parser.parse_args(
        [str(tmp_path / "m"), "--arch", "mistral", "--seed", "3", "--hidden-size", "32"]
        + ["--num-layers", "1", "--vocab-size", "600", "--rope-scaling", "llama3"]
    )
    assert tiny.run(args) == 0
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert config.model_type == "mistral"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 1, 600)
    assert config.rope_scaling["rope_type"] == "llama3"
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_phasefleet_make_tiny_console_command(tmp_path: Path) -> None:
    """The real entry point, `phasefleet make-tiny`, writes a folder our engine serves."""
    from phasefleet.engine.config import EngineConfig
    from phasefleet.engine.llm_engine import LLMEngine
    from phasefleet.engine.sampling_params import SamplingParams

    folder = tmp_path / "cli-model"
    command = [sys.executable, "-m", "phasefleet.cli", "make-tiny", str(folder), "--arch", "qwen2"]
    result = subprocess.run(command + ["--num-layers", "1"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote a random qwen2 model" in result.stdout
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu"))
    prompt = engine.tokenizer.encode("Hello there")
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, seed=1))
    assert len(out.output_token_ids) == 4


def test_tokenizer_round_trips_and_has_specials_and_chat_template(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("qwen2")
    tok = AutoTokenizer.from_pretrained(folder)
    text = "Hello, world! Ünïcödé 🙂 123"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.bos_token and tok.eos_token and tok.bos_token_id != tok.eos_token_id
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith(tok.bos_token) and chat.endswith("<|im_start|>assistant\n")
    config = AutoConfig.from_pretrained(folder)
    assert config.tie_word_embeddings and tok.eos_token_id in config.eos_token_id


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = make_tiny(tmp_path / "a", seed=7)
    b = make_tiny(tmp_path / "b", seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="unknown size argument"):
        make_tiny(tmp_path, hidden=3)
