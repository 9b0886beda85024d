"""The prefix cache as the simulators model it from a trace's block ids: each replica's device
cache and host tier, the prefill they save, the router's prefix-aware choice, and `phasefleet
plan` on a trace that names its blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from phasefleet.api.names import validate_service
from phasefleet.cli import main
from phasefleet.plan.aggregated_sim import simulate_aggregated
from phasefleet.plan.curves import Curves
from phasefleet.plan.disagg_sim import Fleet, simulate
from phasefleet.plan.prefix_cache import PrefixCaching, PrefixModel, ReplicaCache
from phasefleet.plan.search import Shape, Slo, replay, search
from phasefleet.plan.trace import Trace, from_arrays

BT = 128  # tokens per block id in these traces (8 of the engine's KV blocks)
MS = 1e-3  # seconds per prompt token computed


def curves(**overrides: Any) -> Curves:
    """1 ms per prompt token computed, 10 ms a decode step, 1 us of hand-off per token, 10
    blocks of KV."""
    base = Curves(
        name="test",
        prefill=(0.0, 0.001, 0.0),
        decode=(0.01, 0.0, 0.0),
        kv_capacity_tokens=10 * BT,
        max_num_seqs=64,
        startup_s=0.0,
        handoff_bytes_per_s=1e9,
        kv_bytes_per_token=1000,
        chunk_tokens=4096,
    )
    return Curves(**{**base.__dict__, **overrides})


def fixed(trace: Trace, c: Curves, pools: dict[str, int], prefix: PrefixCaching | None) -> Fleet:
    """A disaggregated fleet of `pools` replicas through `trace`."""
    return simulate(trace, c, lambda _f, _t: pools, pools, interval_s=1e9, dt=0.01, prefix=prefix)


def conversation(
    turns: int, gap_s: float = 10.0, new_blocks: int = 2, output: int = 2, first: int = 0
) -> Trace:
    """One conversation: each turn's prompt is the last one plus `new_blocks` blocks (ids
    from `first`)."""
    blocks = [tuple(range(first, first + (t + 1) * new_blocks)) for t in range(turns)]
    prompt = np.array([len(b) * BT for b in blocks])
    arrival = np.arange(turns) * gap_s
    outputs = np.full(turns, output)
    return from_arrays("chat", arrival, prompt, outputs, blocks=blocks, block_tokens=BT)


def test_the_device_cache_keeps_the_most_recent_blocks_and_spills_to_the_host_tier() -> None:
    cache = ReplicaCache(device_blocks=3, host_blocks=2)
    cache.store([1, 2, 3])
    assert cache.lookup([1, 2, 3, 4]) == (3, 0)
    cache.store([7, 8])  # tails leave first: 3, then 2, to the host tier
    assert list(cache.device) == [1, 8, 7] and list(cache.host) == [3, 2]
    assert cache.lookup([1, 2, 3, 4]) == (1, 2)  # the device's hits, then the host tier's
    assert cache.lookup([2, 3]) == (0, 2)
    cache.store([9])  # 1 to the host tier, whose oldest (3) is dropped
    assert list(cache.host) == [2, 1]
    assert cache.lookup([3]) == (0, 0)
    assert cache.lookup([9, 2, 5]) == (1, 1)
    bare = ReplicaCache(device_blocks=1, host_blocks=0)
    bare.store([1, 2])
    assert list(bare.device) == [1] and not bare.host


def test_a_prompt_found_in_the_cache_computes_only_the_rest() -> None:
    c = curves(prefill=(0.005, 0.001, 1e-7))
    assert c.prefill_s(1000, cached=0) == c.prefill_s(1000)
    # the last 400 tokens, each attending to all before it
    assert c.prefill_s(1000, cached=600) == pytest.approx(0.005 + 0.4 + 1e-7 * (1000**2 - 600**2))
    streamed = curves(chunk_tokens=200, handoff_bytes_per_s=1e5)  # 10 ms of link per token
    # the cached 600 tokens' KV leaves at once, ahead of the computed chunks': a longer tail
    assert streamed.handoff_s(1000, cached=600) > streamed.handoff_s(1000)
    assert streamed.handoff_s(1000, cached=600) == pytest.approx(10.0 - 0.4)


def test_admitting_a_prompt_counts_what_was_found_and_the_host_copy() -> None:
    trace = conversation(3)
    model = PrefixModel(trace, PrefixCaching(host_tokens=4 * BT, host_bytes_per_s=1e6), 2 * BT, 10)
    cache = model.new_cache()
    assert model.admit(cache, 0, 2 * BT) == (0.0, 0.0)
    found, load_s = model.admit(cache, 1, 4 * BT)  # blocks 0 and 1 on the device
    assert (found, load_s) == (2 * BT, 0.0)
    found, load_s = model.admit(cache, 2, 6 * BT)  # 0-1 on the device, 2-3 in host memory
    assert found == 4 * BT and load_s == pytest.approx(2 * BT * 10 / 1e6)
    # at least the last token is computed: the engine's last KV block of 16 tokens
    assert model.admit(cache, 0, 2 * BT)[0] == 2 * BT - 16
    stats = model.stats  # each request once
    assert (stats.prompt_tokens, stats.device_tokens, stats.host_tokens) == (
        12 * BT,
        4 * BT,
        2 * BT,
    )
    assert stats.found_share == pytest.approx(6 / 12)
    assert stats.host_share == pytest.approx(2 / 12)
    with pytest.raises(ValueError, match="needs the trace's hash_ids"):
        PrefixModel(Trace("x", np.zeros(1), np.ones(1), np.ones(1)), PrefixCaching(), 100, 1)


def test_a_conversations_next_turn_prefills_only_its_new_blocks_on_a_prefill_replica() -> None:
    trace = conversation(4)
    c = curves()
    pools = {"prefill": 1, "decode": 1}

    def fleet(prefix: PrefixCaching | None) -> np.ndarray:
        sim = fixed(trace, c, pools, prefix)
        return sim.first_token - trace.arrival

    ttft_plain, ttft_cached = fleet(None), fleet(PrefixCaching())
    assert ttft_plain == pytest.approx(np.array([2, 4, 6, 8]) * BT * MS)  # whole prompts
    assert ttft_cached == pytest.approx(np.full(4, 2 * BT * MS))  # the two new blocks a turn


def test_the_host_tier_finds_what_the_device_dropped_at_its_copy_cost() -> None:
    # one-token answers (no decode); the turns outgrow one replica's 10 blocks at the fourth
    trace = conversation(6, new_blocks=3, output=1)
    c = curves()
    pools = {"prefill": 1, "decode": 1}
    runs = {}
    for tier in (0, 20):
        prefix = PrefixCaching(host_tokens=tier * BT, host_bytes_per_s=1e9)
        sim = fixed(trace, c, pools, prefix)
        assert sim.prefix is not None
        runs[tier] = (sim.first_token - trace.arrival, sim.prefix.stats)
    (alone, device_only), (tiered, with_host) = runs[0], runs[20]
    # the device keeps blocks 0-9 (heads outlive tails): the fifth and sixth turns find those
    assert (device_only.device_tokens, device_only.host_tokens) == (38 * BT, 0)
    assert alone[-1] == pytest.approx(8 * BT * MS)  # 8 of its 18 blocks computed
    # the host tier has the tails the device dropped: 10-11 for the fifth, 10-14 for the sixth
    assert (with_host.device_tokens, with_host.host_tokens) == (38 * BT, 7 * BT)
    # 3 blocks computed, 5 copied from host memory at 1 GB/s
    assert tiered[-1] == pytest.approx(3 * BT * MS + 5 * BT * 1000 / 1e9)


def test_a_prefix_aware_router_sends_a_turn_to_the_replica_that_served_the_last() -> None:
    # three conversations taking turns on two prefill replicas, idle at every arrival
    chats = [conversation(4, first=1000 * c) for c in range(3)]
    blocks = [b for turn in zip(*(chat.blocks or () for chat in chats), strict=True) for b in turn]
    prompt = np.array([len(b) * BT for b in blocks])
    arrival = np.arange(12) * 10.0
    trace = from_arrays("three", arrival, prompt, np.full(12, 2), blocks=blocks, block_tokens=BT)
    c = curves(kv_capacity_tokens=40 * BT)
    pools = {"prefill": 2, "decode": 1}
    found = {}
    for aware in (True, False):
        prefix = PrefixCaching(prefix_aware=aware)
        sim = fixed(trace, c, pools, prefix)
        assert sim.prefix is not None
        found[aware] = sim.prefix.stats.found_share
    # prefix-aware: every later turn finds its conversation's last prompt (2 of 4, 4 of 6...)
    assert found[True] == pytest.approx((2 + 4 + 6) * 3 / (sum(prompt) / BT))
    assert found[False] <= found[True] / 2  # the replica free soonest: half land elsewhere


def test_aggregated_workers_skip_the_prefill_of_what_they_cached() -> None:
    trace = conversation(4)
    for aware in (True, False):
        fleet = simulate_aggregated(trace, curves(), 1, PrefixCaching(prefix_aware=aware))
        assert (fleet.first_token - trace.arrival) == pytest.approx(np.full(4, 2 * BT * MS))
        assert fleet.prefix is not None and fleet.prefix.stats.found_share == pytest.approx(
            (2 + 4 + 6) / (2 + 4 + 6 + 8)
        )
    plain = simulate_aggregated(trace, curves(), 1)
    assert (plain.first_token - trace.arrival) == pytest.approx(np.array([2, 4, 6, 8]) * BT * MS)


@pytest.mark.parametrize("aware", [True, False])
def test_either_router_policy_weighs_the_prompt_tokens_a_worker_has_yet_to_compute(
    aware: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a 40-block prompt, then three 1-block prompts; a KV pool so large its use says little
    blocks = [tuple(range(40)), (100,), (200,), (300,)]
    prompt = np.array([len(b) * BT for b in blocks])
    arrival = np.array([0.0, 0.01, 0.015, 0.02])
    trace = from_arrays("long", arrival, prompt, np.full(4, 2), blocks=blocks, block_tokens=BT)
    c = curves(kv_capacity_tokens=10_000 * BT, chunk_tokens=4 * BT)
    caching = PrefixCaching(prefix_aware=aware)
    fleet = simulate_aggregated(trace, c, 2, caching)
    # the fourth goes beside the second and third, not behind the long one
    assert fleet.first_token[3] - arrival[3] < 5 * BT * MS
    # counted in requests alone, the long one's worker holds one and the other two
    monkeypatch.setattr("phasefleet.router.policy.PREFILL_TOKENS_PER_UNIT", float("inf"))
    blind = simulate_aggregated(trace, c, 2, caching)
    assert blind.first_token[3] - arrival[3] > 30 * BT * MS


def test_the_search_tries_both_routers_and_reports_what_was_found() -> None:
    trace = conversation(30, gap_s=1.0, new_blocks=1)
    c = curves(kv_capacity_tokens=40 * BT)
    slo = Slo(ttft_s=0.5, tpot_s=0.05, percentile=0.9)
    plan = search(trace, c, slo, max_gpus=4, context=8192, prefix=PrefixCaching())
    assert plan.best is not None
    assert all(o.prefix is not None for o in plan.candidates)
    assert plan.best.prefix is not None and plan.best.prefix.found_share > 0.9
    plain = search(trace, c, slo, max_gpus=4, context=8192)
    assert all(o.prefix is None and o.shape.router == "least-loaded" for o in plain.candidates)
    one = replay(trace, c, Shape("aggregated", 4096, workers=1), slo, PrefixCaching())
    assert one.attainment == 1.0  # 128 new tokens a turn: 0.128 s each


def write_conversations(path: Path, turns: int) -> None:
    """Eight conversations taking turns every 0.25 s, each turn 512 tokens longer."""
    rows = []
    for t in range(turns):
        for c in range(8):
            ids = [0] + [c * 10_000 + k for k in range(t + 1)]  # a shared system prompt first
            row = {"timestamp": (t * 8 + c) * 250, "input_length": len(ids) * 512}
            rows.append({**row, "output_length": 20, "hash_ids": ids})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_the_command_models_the_cache_and_writes_its_router_and_host_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "chats.jsonl"
    write_conversations(trace, turns=12)
    out = tmp_path / "svc.yaml"
    argv = ["plan", "--trace", str(trace), "--ttft-ms", "300", "--tpot-ms", "40"]
    argv += ["--gpu", "l40s", "--max-gpus", "8", "-o", str(out)]
    assert main([*argv, "--host-kv-cache-gib", "64"]) == 0
    printed = capsys.readouterr().out
    assert "prefix cache modelled from the trace's block ids, a host tier of 64 GiB" in printed
    assert "| router | prompt tokens cached |" in printed and "from host)" in printed
    spec = yaml.safe_load(out.read_text())["spec"]
    parsed = validate_service("planned", spec)  # every rule the CRD enforces
    assert parsed.runtime.host_kv_cache_size == "64Gi"
    best = next(line for line in printed.splitlines() if line.endswith("| best |"))
    assert parsed.router.policy in best
    # computing every prompt whole, no fleet of 8 meets a TTFT that the cache makes easy
    assert main([*argv, "--no-prefix-cache"]) == 1
    plain = capsys.readouterr().out
    assert "prefix cache" not in plain and "router" not in plain
    assert "no fleet of at most 8 GPUs meets the SLO" in plain


def test_a_host_tier_without_block_ids_is_refused_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,5\n1,100,5\n")
    argv = ["plan", "--trace", str(trace), "--ttft-ms", "500", "--tpot-ms", "30"]
    assert main([*argv, "--host-kv-cache-gib", "8"]) == 2
    assert "--host-kv-cache-gib needs the prefix cache modelled, and t has no hash_ids" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--block-tokens", "0"]) == 2
    assert "--block-tokens must be at least 1" in capsys.readouterr().err
