"""Traces read from their files, and curves from a model's shape and a GPU."""

from __future__ import annotations

import json
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
        {"timestamp": 2500, "input_length": 9, "output_length": 3},
    ]
    moon.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = read_trace(moon)
    assert list(trace.arrival) == [0.0, 2.5] and list(trace.prompt) == [40160, 9]


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("t.csv", "when,in,out\n1,2,3\n", "are none of: arrival_s, prompt_tokens"),
        ("t.csv", "arrival_s,prompt_tokens,output_tokens\n1,2,3\nsoon,2,3\n", "request 2"),
        ("t.csv", "arrival_s,prompt_tokens,output_tokens\n1,0,3\n", "must be positive"),
        ("t.csv", "arrival_s,prompt_tokens,output_tokens\n", "no requests"),
        ("t.txt", "1,2,3\n", "a .csv or .jsonl file"),
    ],
    ids=["columns", "bad-row", "empty-prompt", "empty", "suffix"],
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
