"""The aggregated fleet of the simulator (bench/aggregated_sim.py) on small hand-made traces
whose answers can be worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from autoscale_curves import h100_8b

from phasefleet.plan.aggregated_sim import AggregatedFleet, Worker, simulate_aggregated
from phasefleet.plan.curves import Curves
from phasefleet.plan.trace import Trace, latencies

UNCHUNKED = 131072  # token budget of one step: a whole prompt at once


def make_curves(
    chunk_tokens: int = 2048, kv_capacity: int = 100_000, max_num_seqs: int = 8
) -> Curves:
    return Curves(
        name="test",
        prefill=(0.002, 0.001, 0.0),  # 2 ms a step, 1 ms per prompt token
        decode=(0.01, 0.0, 0.0),  # 10 ms a step, whatever the batch
        kv_capacity_tokens=kv_capacity,
        max_num_seqs=max_num_seqs,
        startup_s=0.0,
        handoff_bytes_per_s=1e12,
        kv_bytes_per_token=1,
        chunk_tokens=chunk_tokens,
    )


def make_trace(arrivals: list[float], prompts: list[int], outputs: list[int]) -> Trace:
    return Trace("t", np.array(arrivals), np.array(prompts), np.array(outputs))


def ttft_tpot(fleet: AggregatedFleet) -> tuple[np.ndarray, np.ndarray]:
    return latencies(fleet.trace, fleet.first_token, fleet.finish)  # the replay's scoring


def test_one_request_alone_takes_its_prefill_then_one_decode_step_per_token() -> None:
    curves = h100_8b()
    trace = make_trace([1.0], [2000], [200])  # one chunk of the 2048-token budget
    fleet = simulate_aggregated(trace, curves, workers=1)
    ttft, tpot = ttft_tpot(fleet)
    assert ttft[0] == pytest.approx(curves.prefill_s(2000))
    # step k of the decode holds the prompt and the k tokens before it
    steps = [curves.decode_step_s(1, 2000 + k) for k in range(199)]
    assert tpot[0] == pytest.approx(np.mean(steps))
    assert fleet.gpu_seconds(fleet.end) == pytest.approx(fleet.finish[0])


def test_a_chunked_prompt_pays_the_fixed_overhead_once_per_chunk() -> None:
    trace = make_trace([0.0], [1000], [1])
    whole = simulate_aggregated(trace, make_curves(chunk_tokens=UNCHUNKED), workers=1)
    chunked = simulate_aggregated(trace, make_curves(chunk_tokens=256), workers=1)
    assert whole.first_token[0] == pytest.approx(0.002 + 1.0)
    assert chunked.first_token[0] == pytest.approx(4 * 0.002 + 1.0)  # 256 x 3 + 232
    assert whole.finish[0] == whole.first_token[0]  # one token: done at the first


def test_a_mixed_step_costs_the_decode_and_the_chunk_with_one_fixed_overhead() -> None:
    # A's first token at 12 ms; B arrives then, and the next step carries A's decode and B's
    # whole prompt: 10 ms + (2 ms + 100 ms) - 2 ms; then one decode step of both, 10 ms
    trace = make_trace([0.0, 0.012], [10, 100], [3, 2])
    fleet = simulate_aggregated(trace, make_curves(chunk_tokens=UNCHUNKED), workers=1)
    np.testing.assert_allclose(fleet.first_token, [0.012, 0.122])
    np.testing.assert_allclose(fleet.finish, [0.132, 0.132])


def test_a_long_prefill_stalls_the_decodes_beside_it_unless_chunked() -> None:
    # A decodes 20 more tokens when B's 10k-token prompt (10 s of prefill) arrives
    trace = make_trace([0.0, 0.1], [10, 10_000], [30, 2])
    whole = simulate_aggregated(trace, make_curves(chunk_tokens=UNCHUNKED), workers=1)
    chunked = simulate_aggregated(trace, make_curves(chunk_tokens=64), workers=1)
    alone = simulate_aggregated(make_trace([0.0], [10], [30]), make_curves(), workers=1)
    tpot_alone = ttft_tpot(alone)[1][0]
    assert tpot_alone == pytest.approx(0.01)
    assert ttft_tpot(whole)[1][0] > 30 * tpot_alone  # waited out the whole 10 s step
    # each of A's steps carries at most 63 prompt tokens: 10 ms + 63 ms
    assert ttft_tpot(chunked)[1][0] < 8 * tpot_alone
    # B's prefill costs about the same either way (plus 2 ms per chunk)
    assert chunked.first_token[1] == pytest.approx(whole.first_token[1], rel=0.05)


def test_the_router_sends_a_new_request_to_the_worker_with_the_least_work() -> None:
    trace = make_trace([0.0, 0.0, 0.0], [500, 100, 100], [2, 2, 2])
    fleet = simulate_aggregated(trace, make_curves(), workers=2)
    ttft = ttft_tpot(fleet)[0]
    # 500 on one worker; both 100s on the other, prefilled together in one step
    np.testing.assert_allclose(ttft, [0.502, 0.202, 0.202])


class Checked(AggregatedFleet):
    """Checks KV and batch limits after every step and keeps the batch sizes."""

    def __init__(self, trace: Trace, curves: Curves, workers: int) -> None:
        super().__init__(trace, curves, workers)
        self.batches: list[int] = []

    def _step(self, w: Worker) -> None:
        super()._step(w)
        assert w.kv_decoding() + w.prefill_kv <= self.curves.kv_capacity_tokens
        assert w.running() <= self.curves.max_num_seqs
        self.batches.append(w.running())


def run_checked(trace: Trace, curves: Curves, workers: int) -> Checked:
    fleet = Checked(trace, curves, workers)
    for i in range(len(trace.arrival)):
        fleet.arrive(i)
    for w in fleet.workers:
        fleet.advance(w, np.inf)
    return fleet


def test_kv_capacity_and_max_num_seqs_bound_the_batch_and_no_request_is_lost() -> None:
    rng = np.random.default_rng(0)
    n = 300
    trace = make_trace(
        list(np.sort(rng.uniform(0, 5, n))),
        list(rng.integers(10, 400, n)),
        list(rng.integers(1, 120, n)),
    )
    curves = make_curves(chunk_tokens=128, kv_capacity=2000, max_num_seqs=6)
    fleet = run_checked(trace, curves, workers=2)
    assert fleet.preemptions > 0
    assert max(fleet.batches) == 6
    assert not np.isnan(fleet.finish).any() and not np.isnan(fleet.first_token).any()
    assert (fleet.first_token >= trace.arrival).all() and (fleet.finish >= fleet.first_token).all()
    assert (fleet.made == trace.output).all()


def test_a_preempted_request_recomputes_its_kv_and_keeps_its_tokens() -> None:
    # room for one request's final KV (100 + 101) and a bit: the newer one is preempted
    trace = make_trace([0.0, 0.0], [100, 100], [101, 101])
    fleet = run_checked(trace, make_curves(chunk_tokens=512, kv_capacity=300), workers=1)
    assert fleet.preemptions >= 1
    assert not np.isnan(fleet.finish).any()
    # the older finishes at its own pace; the newer restarts its prompt and tokens later
    tpot = ttft_tpot(fleet)[1]
    assert tpot[0] < 0.011 and tpot[1] > 1.5 * tpot[0]
    assert fleet.first_token[1] == pytest.approx(fleet.first_token[0])  # one step for both


class StepByStep(AggregatedFleet):
    def _decode_stretch(self, w: Worker, until: float) -> bool:
        return False


def test_jumping_a_decode_stretch_gives_the_times_of_stepping_it_one_step_at_a_time() -> None:
    rng = np.random.default_rng(1)
    n = 200
    trace = make_trace(
        list(np.sort(rng.uniform(0, 10, n))),
        list(rng.integers(100, 3000, n)),
        list(rng.integers(1, 300, n)),
    )
    curves = replace(h100_8b(), kv_capacity_tokens=15_000, max_num_seqs=16, chunk_tokens=512)
    jumped = simulate_aggregated(trace, curves, workers=2)
    stepped = StepByStep(trace, curves, 2)
    for i in range(n):
        stepped.arrive(i)
    for w in stepped.workers:
        stepped.advance(w, np.inf)
    assert jumped.preemptions == stepped.preemptions > 0
    np.testing.assert_allclose(jumped.first_token, stepped.first_token, rtol=1e-9)
    np.testing.assert_allclose(jumped.finish, stepped.finish, rtol=1e-9)


def test_a_request_larger_than_the_kv_cache_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        simulate_aggregated(make_trace([0.0], [900], [200]), make_curves(kv_capacity=1000), 1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        simulate_aggregated(make_trace([0.0], [9], [2]), make_curves(chunk_tokens=8), 1)
