"""What a start-up does not pay for: the tokenizer without transformers' auto classes where the
folder names its class (engine/tokenizer.py), and modules built on the meta device without
their initialisers (models/meta.py). Each must give what the slow path gave."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from phasefleet.engine.models.meta import cat_rows, meta_linear, no_init
from phasefleet.engine.tokenizer import load_tokenizer, named_class

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


def with_tokenizer_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return dst


def assert_same_tokenizer(ours: object, reference: object) -> None:
    assert type(ours) is type(reference)
    text = "The quick brown fox, 12 times!"
    assert ours.encode(text) == reference.encode(text)  # type: ignore[attr-defined]
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == (  # type: ignore[attr-defined]
        reference.apply_chat_template(MESSAGES, tokenize=False)  # type: ignore[attr-defined]
    )
    assert ours.all_special_ids == reference.all_special_ids  # type: ignore[attr-defined]


@pytest.mark.parametrize("named", ["PreTrainedTokenizerFast", "LlamaTokenizer", "GPT2Tokenizer"])
def test_a_named_class_loads_as_autotokenizer_would(
    tiny_model: Callable[[str], Path], tmp_path: Path, named: str
) -> None:
    folder = with_tokenizer_config(tiny_model("llama"), tmp_path / "m", tokenizer_class=named)
    assert named_class(folder) is not None
    assert_same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))


def test_folders_that_name_no_class_go_through_autotokenizer(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model("llama")
    unnamed = with_tokenizer_config(src, tmp_path / "unnamed", tokenizer_class=None)
    custom = with_tokenizer_config(src, tmp_path / "custom", auto_map={"AutoTokenizer": ["x", "y"]})
    no_fast = with_tokenizer_config(src, tmp_path / "no-fast", tokenizer_class="NoSuchTokenizer")
    assert named_class(unnamed) is named_class(custom) is named_class(no_fast) is None
    assert_same_tokenizer(load_tokenizer(unnamed), AutoTokenizer.from_pretrained(unnamed))
    with pytest.raises(ValueError, match="NoSuchTokenizer"):  # as AutoTokenizer says it
        load_tokenizer(no_fast)


def test_building_an_engine_does_not_import_dynamo(tiny_model: Callable[[str], Path]) -> None:
    """torch._dynamo costs 0.7 s of a start-up on this CPU, more on the GPU check's host; the
    engine does not need it. (sympy, which a meta initialiser imports here, is left out: torch
    2.11 imports it with transformers anyway.)"""
    folder = tiny_model("qwen2")  # tied embeddings: the CPU pack's output projection too
    code = (
        "import sys\n"
        "from phasefleet.engine.config import EngineConfig\n"
        "from phasefleet.engine.llm_engine import LLMEngine\n"
        f"LLMEngine(EngineConfig(model={str(folder)!r}, device='cpu'))\n"
        "print(sorted(m for m in ('torch._dynamo', 'transformers.models.auto.tokenization_auto')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


def test_meta_modules_skip_their_initialisers_and_restore_them() -> None:
    normal = nn.init.normal_
    with no_init():
        assert nn.init.normal_ is not normal
        with no_init():  # nested: meta_linear inside the loader's block
            linear = meta_linear(4, 6, bias=True)
        assert nn.init.kaiming_uniform_ is not normal
    assert nn.init.normal_ is normal
    assert linear.weight.is_meta and linear.weight.shape == (6, 4) and linear.bias is not None
    assert nn.Linear(4, 4).weight.abs().sum() > 0  # initialised again outside

    parts = [torch.empty(2, 3, device="meta"), torch.empty(5, 3, device="meta")]
    assert cat_rows(parts).shape == (7, 3) and cat_rows(parts).is_meta
    real = [torch.ones(1, 2), torch.zeros(2, 2)]
    assert torch.equal(cat_rows(real), torch.cat(real))


def test_no_init_from_threads_leaves_the_initialisers_in_place() -> None:
    """Tensor-parallel ranks load in threads: however their blocks interleave, the originals
    come back."""
    originals = {n: getattr(nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_")}

    def build() -> None:
        for _ in range(50):
            with torch.device("meta"), no_init():
                nn.Linear(8, 8)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {n: getattr(nn.init, n) for n in originals} == originals
