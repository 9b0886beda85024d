"""The GPU path's host side, run on the CPU: the runner keeps its block tables and each step's
inputs in memory of their own (`separate_device`), as on a GPU, and a DeviceTracer watches every
torch call. A decode step must wait on the device exactly once (the sampled ids), mix no host and
device tensors, move nothing with a blocking copy, and a graph's forward must neither sync nor
make host tensors. And the output still equals transformers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from phasefleet.engine.llm_engine import LLMEngine
from phasefleet.engine.sampling_params import Grammar, SamplingParams
from phasefleet.engine.tiny_lora import make_tiny_lora
from tests.engine.device_tracer import DeviceTracer
from tests.engine.factories import engine_config, finish_all, random_prompts

ModelPath = Callable[[str], Path]
HFGreedy = Callable[[str, list[int], int], list[int]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
def plain_linears(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """nn.Linear everywhere: oneDNN's packed weights have no storage for the tracer to tag."""
    monkeypatch.setenv("PHASEFLEET_CPU_LINEAR", "torch")
    yield


def engine(tiny_model: ModelPath, name: str = "llama", **kw: object) -> LLMEngine:
    config = engine_config(tiny_model(name), device="cpu", block_size=4, **kw)
    return LLMEngine(config, separate_device=True)


def device_tensors(eng: LLMEngine) -> list[torch.Tensor]:
    """What lives on the device: weights and buffers, the KV pool, the block tables, the
    staging copy's device side, the graphs' buffers, the sampling rows' prompt tokens."""
    runner = eng.runner
    found = [*runner.model.parameters(), *runner.model.buffers()]
    found += [runner.model.rope_cos, runner.model.rope_sin]  # type: ignore[list-item]
    found += [t for pair in runner.kv_caches for t in pair] + [runner.tables.device_table]
    for staging in (runner.staging, runner.mask_staging):
        if staging._dev is not None:
            found.append(staging._dev)
    if runner.lora is not None:
        found.append(runner.lora.step.token_slots)
    if runner.graphs is not None:
        g = runner.graphs
        found += [g.input_ids, g.positions, g.slots, g.rows, g.context_lens]
    prompts = [live.row.prompt_on_device for live in eng._live.values()]
    return found + [p for p in prompts if p is not None]


def traced_steps(eng: LLMEngine, steps: int) -> DeviceTracer:
    eng.step()  # the staging buffer's device side exists from the first upload on
    pinned = [eng.runner.staging._host, eng.runner.mask_staging._host]
    tracer = DeviceTracer(device_tensors(eng), pinned=pinned)
    with tracer:
        for _ in range(steps):
            eng.step()
    return tracer


def test_a_decode_step_waits_on_the_device_once(tiny_model: ModelPath, plain_linears: None) -> None:
    eng = engine(tiny_model, num_kv_blocks=64)
    prompts = random_prompts([5, 9, 14], seed=2)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"g{i}", prompt, GREEDY)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    eng.add_request("seeded", random_prompts([7], seed=3)[0], sampled)
    penalized = SamplingParams(
        max_tokens=12, temperature=0.7, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={3: 2.0}, ignore_eos=True,
    )  # fmt: skip
    eng.add_request("penalized", random_prompts([6], seed=4)[0], penalized)
    ruled = SamplingParams(
        max_tokens=12, temperature=0.9, seed=5, grammar=Grammar("regex", "[a-z]{30}")
    )
    eng.add_request("ruled", random_prompts([8], seed=5)[0], ruled)
    eng.step()  # prefills
    tracer = traced_steps(eng, 4)
    assert tracer.mixes == [] and tracer.uploads == []
    assert tracer.syncs == ["tolist"] * 4


def test_a_step_with_prefills_and_decodes_waits_once(
    tiny_model: ModelPath, plain_linears: None
) -> None:
    eng = engine(tiny_model, num_kv_blocks=64, max_num_batched_tokens=8)
    eng.add_request("long", random_prompts([30], seed=4)[0], GREEDY)  # chunked over steps
    eng.add_request("short", random_prompts([3], seed=5)[0], GREEDY)
    tracer = traced_steps(eng, 5)
    assert tracer.mixes == [] and tracer.uploads == []
    assert len(tracer.syncs) <= 5 and set(tracer.syncs) == {"tolist"}


def test_the_graph_path_copies_on_the_device_and_its_forward_can_be_captured(
    tiny_model: ModelPath, plain_linears: None
) -> None:
    eng = engine(tiny_model, num_kv_blocks=64)
    eng.runner.enable_decode_graphs(max_batch=4, capture=False)
    for i, prompt in enumerate(random_prompts([5, 9, 3], seed=6)):
        eng.add_request(f"r{i}", prompt, GREEDY)
    eng.step()
    tracer = traced_steps(eng, 3)
    assert tracer.mixes == [] and tracer.uploads == []
    assert tracer.syncs == ["tolist"] * 3
    graphs = eng.runner.graphs
    assert graphs is not None
    capture = DeviceTracer(device_tensors(eng))
    capture.capturing = True
    with capture, torch.inference_mode():
        graphs._forward(4)  # what capture() records, run eagerly
    assert capture.capture_faults == [] and capture.mixes == []


def test_lora_rows_add_no_wait_and_the_graph_forward_with_deltas_can_be_captured(
    tiny_model: ModelPath, plain_linears: None, tmp_path: Path
) -> None:
    """Adapters mixed with base rows, through the decode graphs' path: still one wait per
    step, no host tensors mixed in, nothing uploaded from pageable memory; the answers are the
    eager path's."""
    adapter = make_tiny_lora(tmp_path / "a", tiny_model("llama"), rank=4, seed=1)
    loras: list[str | None] = ["a", None, "a"]
    prompts = random_prompts([5, 9, 3], seed=6)
    answers = []
    for graphs in (False, True):
        eng = engine(tiny_model, num_kv_blocks=64, lora_adapters={"a": str(adapter)})
        if graphs:
            eng.runner.enable_decode_graphs(max_batch=4, capture=False)
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
            eng.add_request(f"r{i}", prompt, GREEDY, lora=lora)
        eng.step()
        tracer = traced_steps(eng, 3)
        assert tracer.mixes == [] and tracer.uploads == []
        assert tracer.syncs == ["tolist"] * 3
        answers.append(finish_all(eng))
        if graphs:
            assert eng.runner.graphs is not None
            capture = DeviceTracer(device_tensors(eng))
            capture.capturing = True
            with capture, torch.inference_mode():
                eng.runner.graphs._forward(4)
            assert capture.capture_faults == [] and capture.mixes == []
    eager, graphed = ({k: o.output_token_ids for k, o in a.items()} for a in answers)
    assert eager == graphed and len({tuple(v) for v in eager.values()}) == 3


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_separate_device_memory_still_equals_transformers(
    tiny_model: ModelPath, hf_greedy: HFGreedy, graphs: bool
) -> None:
    """Block-table rows written by updates, reused after a request ends, rewritten after a
    preemption (the pool is too small for the batch), inputs through the staging copy."""
    eng = engine(tiny_model, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
    if graphs:
        eng.runner.enable_decode_graphs(max_batch=4, capture=False)
    prompts = random_prompts([3, 17, 30, 9, 25, 4, 12], seed=21)
    for prompt, out in zip(prompts, eng.generate(prompts, GREEDY), strict=True):
        assert out.output_token_ids == hf_greedy("llama", prompt, GREEDY.max_tokens)
    assert eng.stats().num_preemptions_total > 0
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_the_tracer_sees_syncs_mixes_uploads_and_capture_faults() -> None:
    device, pinned = torch.zeros(4), torch.ones(4)
    tracer = DeviceTracer([device], pinned=[pinned])
    with tracer:
        made = torch.arange(4, device="cpu")  # explicit device=: device memory
        total = (device + made).sum()
        host = torch.ones(4)
        device.copy_(pinned)  # the one way in: an explicit copy from pinned memory
        device.copy_(host)  # an upload: from pageable memory
        _ = device * host  # a mix
        _ = host.to("cpu")  # an upload (pageable, blocking on a GPU)
        _ = total.item()  # a sync
        tracer.capturing = True
        _ = torch.ones(2)  # a host tensor made during capture
        _ = total.tolist()
    assert tracer.syncs == ["item", "tolist"]
    assert tracer.mixes == ["mul: 1 device and 1 host tensors"]
    assert tracer.uploads == ["copy_ from a pageable host tensor (4,)", "to of a host tensor (4,)"]
    assert tracer.capture_faults == [
        "ones made a host tensor during capture",
        "tolist synced during capture",
    ]
