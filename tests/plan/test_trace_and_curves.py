"""Traces read from their files, and curves from a model's shape and a GPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from phasefleet.plan.curves import ModelShape, roofline
from phasefleet.plan.gpus import GPUS
from phasefleet.plan.trace import read_trace


def test_our_csv_is_read_sorted_from_the_first_arrival(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n12.5,300,4\n10,100,0\n11,200,7\n")
    trace = read_trace(path)
    assert trace.name == "mine"
    assert list(trace.arrival) == [0.0, 1.0, 2.5]
    assert list(trace.prompt) == [100, 200, 300]
    assert list(trace.output) == [1, 7, 4]  # an answer has at least one token


def test_published_azure_csv_and_mooncake_jsonl_are_read(tmp_path: Path) -> None:
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109"
    )
    trace = read_trace(azure)
    assert trace.arrival[1] == pytest.approx(4.314579)
    assert list(trace.prompt) == [374, 396]
    moon = tmp_path / "moon.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1]},
        {"timestamp": 2500, "input_length": 9, "output_length": 3, "hash_ids": [0]},
        {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
    ]
    moon.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = read_trace(moon)
    assert list(trace.arrival) == [0.0, 1.0, 2.5] and list(trace.prompt) == [40160, 600, 9]
    assert trace.blocks == ((0, 1), (0, 2), (0,)) and trace.block_tokens == 512  # sorted alike
    assert read_trace(moon, block_tokens=16).block_tokens == 16
    assert read_trace(azure).blocks is None


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("t.csv", "when,in,out\n1,2,3\n", "are none of: arrival_s, prompt_tokens"),
        ("t.csv", "arrival_s,prompt_tokens,output_tokens\n1,2,3\nsoon,2,3\n", "request 2"),
        ("t.csv", "arrival_s,prompt_tokens,output_tokens\n1,0,3\n", "must be positive"),
        ("t.csv", "arrival_s,prompt_tokens,output_tokens\n", "no requests"),
        ("t.txt", "1,2,3\n", "a .csv or .jsonl file"),
        (
            "t.jsonl",
            '{"timestamp": 0, "input_length": 9, "output_length": 3, "hash_ids": [1]}\n'
            '{"timestamp": 1, "input_length": 9, "output_length": 3}\n',
            "request 2: hash_ids must be a list of integers",
        ),
        (
            "t.jsonl",
            '{"timestamp": 0, "input_length": 9, "output_length": 3, "hash_ids": ["a"]}\n',
            "request 1: hash_ids must be a list of integers",
        ),
    ],
    ids=["columns", "bad-row", "empty-prompt", "empty", "suffix", "some-hash-ids", "bad-hash-ids"],
)
def test_a_file_that_is_not_a_trace_is_refused_saying_why(
    tmp_path: Path, name: str, text: str, words: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        read_trace(path)


def test_a_models_shape_comes_from_its_config(tmp_path: Path) -> None:
    config = {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_config(tmp_path)
    assert shape.params == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M
    assert shape.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no vocab_size"):
        ModelShape.from_config(tmp_path / "config.json")


def test_an_image_text_models_shape_is_its_decoders(tmp_path: Path) -> None:
    config = {  # google/gemma-3-4b-it's: heads and vocabulary left to the class defaults
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_config(tmp_path)
    assert shape.params == pytest.approx(3.88e9, rel=0.01)  # its decoder, without the tower
    assert shape.kv_bytes_per_token == 34 * 4 * 256 * 2 * 2


@pytest.mark.parametrize(
    ("fields", "total", "active"),
    [
        (  # Mixtral-8x7B: every layer's 8 experts, 2 per token
            dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                 vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
            46.7e9, 12.9e9,
        ),
        (  # Qwen3-30B-A3B: 128 experts 768 wide, 8 per token
            dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, vocab_size=151936,
                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[]),
            30.5e9, 3.3e9,
        ),
    ],
)  # fmt: skip
def test_a_mixture_of_experts_holds_every_expert_and_computes_with_the_chosen(
    tmp_path: Path, fields: dict[str, object], total: float, active: float
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    shape = ModelShape.from_config(tmp_path)
    assert shape.params == pytest.approx(total, rel=0.01)
    assert shape.active_params == pytest.approx(active, rel=0.02)
    h200 = roofline(shape, GPUS["h200"])
    dense = roofline(replace(shape, active_params=None), GPUS["h200"])
    flops_share = shape.flop_params / shape.params  # a prompt token's FLOPs: the active params
    assert h200.prefill[1] == pytest.approx(dense.prefill[1] * flops_share)
    assert h200.decode[0] == dense.decode[0]  # a step reads every weight
    del fields["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="no num_experts_per_tok"):
        ModelShape.from_config(tmp_path)


def test_a_float8_kv_pool_holds_twice_the_tokens_and_reads_half_the_bytes() -> None:
    llama = ModelShape("llama-3-8b", 8.03e9, 32, 4096, 8, 128)
    bf16, fp8 = (
        roofline(llama, GPUS["h100"]),
        roofline(replace(llama, kv_dtype_bytes=1), GPUS["h100"]),
    )
    assert bf16.kv_bytes_per_token == 2 * fp8.kv_bytes_per_token == 131072
    assert fp8.kv_capacity_tokens == pytest.approx(2 * bf16.kv_capacity_tokens, abs=1)
    assert fp8.decode[2] == pytest.approx(bf16.decode[2] / 2)  # the KV a step reads
    assert fp8.decode[:2] == bf16.decode[:2] and fp8.prefill == bf16.prefill  # weights alike
    assert fp8.handoff_s(1000) < bf16.handoff_s(1000)
    assert "float8 KV" in fp8.name


def test_the_roofline_scales_with_the_gpu_and_refuses_a_model_too_large() -> None:
    llama = ModelShape("llama-3-8b", 8.03e9, 32, 4096, 8, 128)
    h100, h200 = roofline(llama, GPUS["h100"]), roofline(llama, GPUS["h200"])
    assert h100.decode[0] == pytest.approx(0.004 + 2 * 8.03e9 / (3.35e12 * 0.8))  # weights
    assert h200.decode_step_s(1, 0) < h100.decode_step_s(1, 0)  # more bandwidth
    assert h200.kv_capacity_tokens > 2 * h100.kv_capacity_tokens  # 141 GB against 80
    assert h100.prefill_s(2048) == pytest.approx(h200.prefill_s(2048))  # the same FLOP/s
    huge = ModelShape("70b", 70e9, 80, 8192, 8, 128)
    with pytest.raises(ValueError, match="needs tensor parallelism"):
        roofline(huge, GPUS["h100"])
