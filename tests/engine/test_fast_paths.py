"""The GPU fast paths, checked as far as a CPU allows: the split-K Triton paged-decode kernels
through Triton's interpreter and compiled to PTX/cubin for sm_90, and their split plan; the
CUDA-graph decode path eagerly (captured as graphs with PHASEFLEET_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phasefleet.engine.attention import triton_decode
from phasefleet.engine.cuda_graphs import DecodeGraphs, batch_sizes
from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.model_runner import choose_decode_backend
from phasefleet.engine.sampling_params import SamplingParams
from tests.engine.factories import DEVICE, engine_config, random_prompts

ModelPath = Callable[[str], Path]
HFGreedy = Callable[[str, list[int], int], list[int]]


def test_triton_kernel_in_the_interpreter_matches_torch(tiny_model: ModelPath) -> None:
    script = Path(__file__).with_name("triton_interpret_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    models = [str(tiny_model(name)) for name in ("llama", "mistral_sw", "gemma3")]
    result = subprocess.run(
        [sys.executable, str(script), *models], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def _compile_sm90(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> Any:
    """The kernel's PTX and cubin for an H100, compiled without a GPU -> {"ptx": ..., ...}."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm


STRIDES = ("stride_qb", "stride_qh", "stride_kn", "stride_kt", "stride_kh", "stride_tb")


@pytest.mark.parametrize(
    ("dtype", "kv", "group", "head_dim"),
    [
        ("bf16", "bf16", 4, 128),
        ("fp16", "fp16", 3, 64),
        ("bf16", "bf16", 8, 64),
        ("fp32", "fp32", 1, 128),
        ("bf16", "bf16", 4, 256),
        ("bf16", "fp8e4nv", 4, 128),
    ],
    ids=["llama3-8b", "smollm2", "group8", "mha-fp32", "gemma3-1b", "llama3-8b-fp8-kv"],
)
def test_split_kernel_compiles_for_sm90(dtype: str, kv: str, group: int, head_dim: int) -> None:
    signature = {
        **{name: f"*{dtype}" for name in ("Q", "Out")},
        **{name: f"*{kv}" for name in ("K", "V")},
        **{name: "*fp32" for name in ("Acc", "Max", "Sum")},
        "tables": "*i64",
        "ctx_lens": "*i64",
        "qk_scale": "fp32",
        **{name: "i32" for name in ("window", "splits", "min_tiles", *STRIDES)},
        **{name: "i32" for name in ("stride_ob", "stride_oh")},
    }
    constexprs = {
        "GROUP": group,
        "GROUP_P": 16,
        "BLOCK": 16,
        "TILE": triton_decode.TILE,
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_dim,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    asm = _compile_sm90(triton_decode.split_kernel, signature, constexprs)
    assert asm["cubin"]
    # 16-bit queries score and weight on the tensor cores (a float8 pool's values cast to
    # theirs); float32 stays exact (no tf32 mma)
    assert ("mma.sync" in asm["ptx"]) == (dtype != "fp32")


def test_combine_kernel_compiles_for_sm90() -> None:
    signature = {
        "Out": "*bf16",
        **{name: "*fp32" for name in ("Acc", "Max", "Sum")},
        "ctx_lens": "*i64",
        **{name: "i32" for name in ("window", "splits", "min_tiles", "stride_ob", "stride_oh")},
    }
    constexprs = {"TILE": triton_decode.TILE, "HEAD_DIM": 128, "BLOCK_D": 128}
    assert _compile_sm90(triton_decode.combine_kernel, signature, constexprs)["cubin"]


def test_split_plan_fills_the_gpu_without_splitting_short_contexts() -> None:
    plan = triton_decode.plan_splits  # (batch, kv_heads, max_tokens, num_sms)
    assert plan(1, 8, 8192, 132) == 32  # 256 programs for 132 SMs; 256-token splits
    assert plan(1, 8, 131072, 132) == 33  # 2 x 132 programs
    assert plan(1, 8, 300, 132) == 2  # no split under 256 tokens
    assert plan(1, 8, 256, 132) == plan(64, 8, 8192, 132) == 1  # short, or batch fills the GPU
    assert plan(1, 1, 10**6, 132) == triton_decode.MAX_SPLITS
    # a workspace for every batch up to 256: b x splits(b) rows at most, 256 here
    workspace = triton_decode.DecodeWorkspace.for_batches(256, 32, 8, 128, 8192, "cpu")
    assert workspace.acc.shape == (256, 32, 128) and workspace.max.shape == (256, 32)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_decode_backend(cpu, 16) == "torch"
    assert choose_decode_backend(cuda, 16) == "triton"
    assert choose_decode_backend(cuda, 12) == "torch"  # not a power of two
    assert choose_decode_backend(cuda, 16, softcap=True) == "torch"  # Gemma 2: no kernel
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_decode_backend(cuda, 16, float8_kv=True) == "triton"  # an H100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choose_decode_backend(cuda, 16, float8_kv=True) == "torch"  # an A100: no float8
    assert choose_decode_backend(cuda, 16) == "triton"
    monkeypatch.setenv("PHASEFLEET_ATTENTION", "torch")
    assert choose_decode_backend(cuda, 16) == "torch"
    monkeypatch.setenv("PHASEFLEET_ATTENTION", "triton")
    with pytest.raises(ValueError, match="power-of-two block_size"):
        choose_decode_backend(cpu, 12)
    with pytest.raises(ValueError, match="and a softcapped model"):
        choose_decode_backend(cuda, 16, softcap=True)
    with pytest.raises(ValueError, match="a float8 KV pool on a GPU before sm89"):
        choose_decode_backend(cuda, 16, float8_kv=True)
    monkeypatch.setenv("PHASEFLEET_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="PHASEFLEET_ATTENTION must be"):
        choose_decode_backend(cpu, 16)


def test_graph_batch_sizes() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("name", ["llama", "mistral_sw", "gemma2", "gemma3"])
def test_padded_decode_path_matches_transformers(
    name: str, tiny_model: ModelPath, hf_greedy: HFGreedy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-graph decode path (fixed-shape buffers, padded batches), run eagerly on the CPU
    and captured as graphs on CUDA."""
    config = engine_config(
        tiny_model(name),
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=32,
        max_model_len=128,
    )
    eng = LLMEngine(config)
    eng.runner.enable_decode_graphs(max_batch=6, capture=DEVICE == "cuda")
    calls: list[int] = []
    run = DecodeGraphs.run

    def counting_run(self: DecodeGraphs, *inputs: torch.Tensor) -> object:
        calls.append(len(inputs[0]))  # input_ids: one per request
        return run(self, *inputs)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    prompts = random_prompts([3, 17, 30, 9, 25, 4, 12], seed=21)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = eng.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.output_token_ids == hf_greedy(name, prompt, params.max_tokens)
    assert calls and max(calls) <= 6
    assert set(calls) - set(batch_sizes(6))  # some steps were padded up to a captured size
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks
