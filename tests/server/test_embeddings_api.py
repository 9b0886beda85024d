"""POST /v1/embeddings on a real worker through the official client: the last token's final
hidden state as transformers' base model gives it, normalized, in both encodings, batched,
cut to `dimensions`; bad input is a 400 naming the field. How a sentence-transformers folder
pools is read from its modules (server/pooling.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from phasefleet.server.pooling import Pooling
from tests.server.worker_proc import Worker, run_worker


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tokenizer: Any) -> Any:
    """reference(text or ids) -> transformers' last hidden state of its last token."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def last_hidden(prompt: str | list[int]) -> np.ndarray:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()

    return last_hidden


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def test_an_embedding_is_the_normalized_last_hidden_state(
    client: openai.OpenAI, reference: Any
) -> None:
    text = "The tide comes in over the harbour wall"
    got = client.embeddings.create(model="tiny", input=text)  # the client asks for base64
    assert got.model == "tiny" and got.object == "list" and len(got.data) == 1
    vector = np.asarray(got.data[0].embedding)
    np.testing.assert_allclose(vector, unit(reference(text)), atol=1e-5)
    plain = client.embeddings.create(model="tiny", input=text, encoding_format="float")
    np.testing.assert_allclose(np.asarray(plain.data[0].embedding), vector, atol=1e-6)


def test_a_batch_of_texts_and_token_ids_keeps_its_order_and_counts_its_tokens(
    client: openai.OpenAI, reference: Any, tokenizer: Any
) -> None:
    texts = ["a short one", "a somewhat longer input " * 6, "x"]
    got = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in got.data] == [0, 1, 2]
    for data, text in zip(got.data, texts, strict=True):
        np.testing.assert_allclose(np.asarray(data.embedding), unit(reference(text)), atol=1e-5)
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    ids = [[5, 17, 99, 3], [42] * 9]
    by_ids = client.embeddings.create(model="tiny", input=ids)
    for data, prompt in zip(by_ids.data, ids, strict=True):
        np.testing.assert_allclose(np.asarray(data.embedding), unit(reference(prompt)), atol=1e-5)
    single = client.embeddings.create(model="tiny", input=ids[0])
    np.testing.assert_allclose(single.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)


def test_dimensions_keeps_the_first_values_normalized_again(
    client: openai.OpenAI, reference: Any
) -> None:
    text = "matryoshka"
    got = client.embeddings.create(model="tiny", input=text, dimensions=8)
    vector = np.asarray(got.data[0].embedding)
    np.testing.assert_allclose(vector, unit(reference(text)[:8]), atol=1e-5)
    raw = client.embeddings.create(model="tiny", input=text, extra_body={"normalize": False})
    np.testing.assert_allclose(np.asarray(raw.data[0].embedding), reference(text), atol=1e-4)


@pytest.mark.parametrize(
    ("kw", "param", "words"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [[1, 2], []]}, "input", "must not be empty"),
        ({"input": [10**6]}, "input", "outside the vocabulary"),
        ({"input": "word " * 5000}, "input", "maximum context length"),
        ({"input": ["x"] * 2049}, "input", "more than 2048"),
        ({"input": "x", "dimensions": 10**4}, "dimensions", "must be <= this model's"),
        ({"input": "x", "dimensions": 0}, "dimensions", ""),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, kw: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny", **kw)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"]


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def write_modules(folder: Path, modules: list[str], pooling: dict[str, bool] | None) -> Path:
    entries = [
        {"idx": i, "path": f"{i}_{m}", "type": f"st.models.{m}"} for i, m in enumerate(modules)
    ]
    (folder / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (folder / f"{modules.index('Pooling')}_Pooling").mkdir(exist_ok=True)
        (folder / f"{modules.index('Pooling')}_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 64, **pooling})
        )
    return folder


def test_a_sentence_transformers_folder_says_how_it_pools(tmp_path: Path) -> None:
    assert Pooling.of_model(tmp_path, 64) == Pooling(True, None, 64)  # a plain causal model
    last = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    normalized = write_modules(tmp_path, ["Transformer", "Pooling", "Normalize"], last)
    assert Pooling.of_model(normalized, 64) == Pooling(True, None, 64)
    raw = write_modules(tmp_path, ["Transformer", "Pooling"], last)
    assert Pooling.of_model(raw, 64) == Pooling(False, None, 64)
    mean = write_modules(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True})
    assert "pools by pooling_mode_mean_tokens" in str(Pooling.of_model(mean, 64).refused)
    dense = write_modules(tmp_path, ["Transformer", "Pooling", "Dense", "Normalize"], last)
    assert "adds Dense after pooling" in str(Pooling.of_model(dense, 64).refused)
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="modules.json is not valid JSON"):
        Pooling.of_model(tmp_path, 64)
    (tmp_path / "modules.json").write_text('{"type": "Pooling"}')
    with pytest.raises(ValueError, match="modules.json is not a list of modules"):
        Pooling.of_model(tmp_path, 64)
    listed = write_modules(tmp_path, ["Transformer", "Pooling"], last)
    (listed / "1_Pooling" / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="1_Pooling/config.json is not a JSON object"):
        Pooling.of_model(listed, 64)


@pytest.fixture(scope="module")
def mean_pooled_worker(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    folder = tmp_path_factory.mktemp("mean") / "model"
    shutil.copytree(tiny_model, folder)
    write_modules(folder, ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True})
    with run_worker(folder) as worker:
        yield worker


def test_a_model_that_pools_otherwise_is_refused_and_still_generates(
    mean_pooled_worker: Worker,
) -> None:
    client = mean_pooled_worker.client()
    with pytest.raises(openai.BadRequestError, match="pools by pooling_mode_mean_tokens"):
        client.embeddings.create(model="tiny", input="x")
    answer = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert answer.choices[0].text is not None
