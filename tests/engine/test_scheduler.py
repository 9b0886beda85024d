"""The scheduler on its own: budget order, chunking, admission, preemption, finishing."""

from __future__ import annotations

import pytest

from phasefleet.engine.request import RequestStatus
from phasefleet.engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.factories import make_requests, make_scheduler


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One schedule + update, sampling `token` for every request that reaches its end."""
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.sample}
    sched.update_from_output(out, sampled)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def test_new_requests_are_prefilled_in_chunks_within_the_budget() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=10)
    for r in make_requests(2, 12):
        sched.add_request(r)
    out = run_step(sched)
    assert plan(out) == [("r0", 10)]
    assert out.num_batched_tokens == 10
    assert (sched.prefill_tokens_pending, sched.prefill_tokens_waiting) == (2, 12)  # r1 queued
    assert not out.scheduled[0].sample
    # r0's last 2 prompt tokens, then r1's first chunk with the rest of the budget.
    out = run_step(sched)
    assert plan(out) == [("r0", 2), ("r1", 8)]
    assert out.scheduled[0].sample
    assert sched.prefill_tokens_pending == 4


def test_decodes_come_first_then_prefill_chunks_then_new_requests() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    a, b, c = make_requests(3, 16)
    a.prompt_token_ids = a.prompt_token_ids[:6]
    c.prompt_token_ids = c.prompt_token_ids[:4]
    sched.add_request(a)
    assert plan(run_step(sched)) == [("r0", 6)]
    sched.add_request(b)
    sched.add_request(c)
    assert plan(run_step(sched)) == [("r0", 1), ("r1", 7)]
    assert plan(run_step(sched)) == [("r0", 1), ("r1", 7)]
    assert plan(run_step(sched)) == [("r0", 1), ("r1", 2), ("r2", 4)]
    assert plan(run_step(sched)) == [("r0", 1), ("r1", 1), ("r2", 1)]


def test_decodes_beyond_the_budget_wait_for_the_next_step() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=12)
    for r in make_requests(3, 4):
        sched.add_request(r)
    run_step(sched)
    sched.max_num_batched_tokens = 2
    assert plan(run_step(sched)) == [("r0", 1), ("r1", 1)]


def test_admission_needs_room_for_the_whole_prompt() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=4)  # 5 usable
    big, small = make_requests(2, 12, max_tokens=4)
    small.prompt_token_ids = small.prompt_token_ids[:8]
    sched.add_request(big)
    out = run_step(sched)
    assert plan(out) == [("r0", 4)]  # admitted with all 3 blocks, prefilled 4 tokens at a time
    assert sched.kv.pool.num_free_blocks == 2
    assert plan(run_step(sched)) == [("r0", 4)]
    assert plan(run_step(sched)) == [("r0", 4)]
    sched.add_request(small)
    # big's first decode takes a 4th block; small needs 2 and only 1 is free: it waits.
    assert plan(run_step(sched)) == [("r0", 1)]
    assert sched.waiting[0] is small
    while not big.is_finished:
        run_step(sched)
    assert plan(run_step(sched)) == [("r1", 4)]


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable
    big, later = make_requests(2, 20)
    later.prompt_token_ids = later.prompt_token_ids[:4]
    (first,) = make_requests(1, 4, prefix="first")
    sched.add_request(first)
    sched.add_request(big)  # 5 blocks: can never fit alongside anything
    sched.add_request(later)
    out = run_step(sched)
    assert plan(out) == [("first0", 4)]
    assert [r.request_id for r in sched.waiting] == ["r0", "r1"]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for r in make_requests(3, 4):
        sched.add_request(r)
    run_step(sched)
    assert len(sched.running) == 2
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preemption_evicts_the_newest_and_recomputes_it_later() -> None:
    # 4 usable blocks of 4 tokens; two 8-token prompts fill them.
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    old, new = make_requests(2, 8, max_tokens=8)
    sched.add_request(old)
    sched.add_request(new)
    run_step(sched)  # both prefilled, each sampled a 9th token
    assert sched.kv.pool.num_free_blocks == 0
    out = run_step(sched)  # old needs a third block: new is preempted
    assert out.preempted == ["r1"]
    assert plan(out) == [("r0", 1)]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new
    assert sched.num_preemptions_total == 1
    assert sched.kv.pool.num_free_blocks == 1
    # When old finishes, new comes back and recomputes prompt + its output so far.
    while not old.is_finished:
        run_step(sched)
    out = run_step(sched)
    assert plan(out) == [("r1", 9)]
    assert new.status is RequestStatus.RUNNING


def test_a_lone_request_that_outgrows_the_pool_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)  # 2 usable blocks
    (r,) = make_requests(1, 8)
    sched.add_request(r)
    run_step(sched)
    out = run_step(sched)
    assert out.preempted == ["r0"] and out.scheduled == []
    assert sched.waiting[0] is r


def test_finish_on_max_tokens_eos_and_stop_token_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=16, eos_token_ids=(2,))
    a, b, c = make_requests(3, 4, max_tokens=3)
    a.params.ignore_eos = False
    c.params.stop_token_ids = [9]
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    changed = sched.update_from_output(out, {"r0": 2, "r1": 2, "r2": 9})
    assert [r.request_id for r in changed] == ["r0", "r1", "r2"]
    assert a.finish_reason == "stop" and a.is_finished  # eos
    assert not b.is_finished  # ignore_eos
    assert c.finish_reason == "stop"  # stop token
    run_step(sched)
    run_step(sched)
    assert b.finish_reason == "length" and b.output_token_ids == [2, 7, 7]
    assert sched.kv.pool.num_free_blocks == 15
    assert not sched.has_unfinished_requests()


def test_finish_request_on_waiting_and_unknown_ids() -> None:
    sched = make_scheduler()
    (r,) = make_requests(1, 4)
    sched.add_request(r)
    assert sched.finish_request("nope", "abort") is None
    assert sched.finish_request("r0", "abort") is r
    assert r.finish_reason == "abort" and not sched.waiting


def test_prefix_hits_skip_cached_tokens_and_are_counted() -> None:
    sched = make_scheduler(num_blocks=32)
    (a,) = make_requests(1, 10)
    sched.add_request(a)
    run_step(sched)
    (b,) = make_requests(1, 10, prefix="b")  # same tokens as a
    sched.add_request(b)
    out = run_step(sched)
    assert plan(out) == [("r0", 1), ("b0", 2)]  # 8 of 10 tokens (two full blocks) cached
    assert b.num_cached_tokens == 8
    assert sched.prefix_cache_hits_total == 8
    assert sched.prefix_cache_queries_total == 20


def test_first_scheduled_time_and_prompt_counter() -> None:
    sched = make_scheduler()
    (r,) = make_requests(1, 5)
    sched.add_request(r)
    run_step(sched)
    assert r.first_scheduled_time == 123.0
    assert sched.prompt_tokens_total == 5
    assert sched.generation_tokens_total == 1


def admission_order(sched: Scheduler) -> list[str]:
    """The requests in the order they are first admitted, one a step."""
    order: list[str] = []
    while sched.num_waiting:
        order += run_step(sched).admitted
    return order


def late_scheduler(late_limit_s: float = 60.0, per_request: bool = False) -> Scheduler:
    """TTFT target 1 s, the clock at 5.8 s; r0-r3 arrived at 0, 0.5, 5 and 5.5 s, and each
    prompt takes a whole step's budget, so one is admitted a step. `per_request`: the target
    comes with each request (as the router sends it), not with the scheduler."""
    sched = make_scheduler(
        num_blocks=64,
        max_num_batched_tokens=8,
        clock=lambda: 5.8,
        late_after_s=None if per_request else 1.0,
        late_limit_s=late_limit_s,
    )
    for r, arrived in zip(make_requests(4, 8, max_tokens=1), (0.0, 0.5, 5.0, 5.5), strict=True):
        r.arrival_time = arrived
        r.late_after_s = 1.0 if per_request else None
        sched.add_request(r)
    return sched


def test_late_prompts_go_behind_the_ones_that_can_still_meet_the_target() -> None:
    sched = late_scheduler()
    assert admission_order(sched) == ["r2", "r3", "r0", "r1"]
    assert sched.late_prompts_total == 2  # counted once, though they waited several steps


def test_a_target_sent_with_each_request_serves_late_prompts_last_alike() -> None:
    assert admission_order(late_scheduler(per_request=True)) == ["r2", "r3", "r0", "r1"]
    fcfs = late_scheduler(per_request=True)
    for r in fcfs.waiting:
        r.late_after_s = None  # no target anywhere: first come, first served
    assert admission_order(fcfs) == ["r0", "r1", "r2", "r3"]


def test_a_prompt_arriving_after_the_late_ones_went_behind_goes_ahead_of_them() -> None:
    sched = late_scheduler()
    assert run_step(sched).admitted == ["r2"]  # r0 and r1 are late now
    (fresh,) = make_requests(1, 8, max_tokens=1, prefix="f")
    fresh.arrival_time = 5.8
    sched.add_request(fresh)
    assert admission_order(sched) == ["r3", "f0", "r0", "r1"]


def test_a_late_prompt_waiting_past_the_limit_is_served_in_its_turn() -> None:
    sched = late_scheduler(late_limit_s=5.5)  # r0 has waited 5.8 s, r1 5.3 s
    assert admission_order(sched) == ["r0", "r2", "r3", "r1"]
    assert sched.late_prompts_total == 1


def test_late_prompts_go_back_to_the_front_once_they_waited_the_limit() -> None:
    now = [5.8]
    sched = make_scheduler(
        num_blocks=64, max_num_batched_tokens=8, clock=lambda: now[0], late_after_s=1.0
    )
    sched.late_limit_s = 10.0
    for r, arrived in zip(make_requests(3, 8, max_tokens=1), (0.0, 5.0, 5.5), strict=True):
        r.arrival_time = arrived
        sched.add_request(r)
    assert run_step(sched).admitted == ["r1"]  # r0 went late
    now[0] = 10.0  # r0 has waited 10 s: its turn again, ahead of r2 (late by now too)
    assert admission_order(sched) == ["r0", "r2"]
    assert sched.late_prompts_total == 2


def test_without_a_ttft_target_the_queue_is_first_come_first_served() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8, clock=lambda: 5.8)
    for r, arrived in zip(make_requests(3, 8, max_tokens=1), (0.0, 5.0, 5.5), strict=True):
        r.arrival_time = arrived
        sched.add_request(r)
    assert admission_order(sched) == ["r0", "r1", "r2"]
    assert sched.late_prompts_total == 0


def test_requests_past_their_first_token_are_never_late() -> None:
    """A request handed over with its first token (a decode worker's) or carrying KV keeps its
    place: its time to first token was the prefill worker's."""
    sched = late_scheduler()
    handed, importing = make_requests(2, 8, max_tokens=4, prefix="h")
    handed.output_token_ids = [5]
    importing.num_imported_tokens = 4
    for r in (handed, importing):
        r.arrival_time = 0.0
    sched.waiting.extendleft([importing, handed])
    sched.requests.update({r.request_id: r for r in (handed, importing)})
    assert admission_order(sched)[:4] == ["h0", "h1", "r2", "r3"]


def test_a_late_prompt_waits_while_another_prompt_is_still_being_prefilled() -> None:
    """A late prompt takes only prefill capacity nothing else wants: not a step's leftover
    budget beside an unfinished prompt, whose chunks it would then hold up."""
    sched = make_scheduler(
        num_blocks=64, max_num_batched_tokens=8, clock=lambda: 5.8, late_after_s=1.0
    )
    on_time, late = make_requests(2, 20, max_tokens=1)  # 20 tokens: three steps of 8
    on_time.arrival_time, late.arrival_time = 5.5, 0.0
    sched.add_request(late)
    sched.add_request(on_time)
    admitted = [run_step(sched).admitted for _ in range(4)]
    # the third step has 4 tokens of budget left beside r0's last chunk; r1 waits for the next
    assert admitted == [["r0"], [], [], ["r1"]]


def test_the_priority_policy_admits_the_most_urgent_first_arrival_breaking_ties() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=1, policy="priority")
    first, batch, urgent, batch_late = make_requests(4, 4, max_tokens=2)
    first.priority, batch.priority, urgent.priority, batch_late.priority = 0, 5, -1, 5
    for r in (first, batch, batch_late, urgent):  # urgent arrives last
        sched.add_request(r)
    assert plan(run_step(sched)) == [("r2", 4)]  # the most urgent, though it came last
    order = []
    while sched.has_unfinished_requests():
        order += run_step(sched).admitted
    assert order == ["r0", "r1", "r3"]  # then by priority, arrival order among equals


def test_the_priority_policy_preempts_the_least_urgent_not_the_newest() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, policy="priority")  # 5 usable blocks
    low, high = make_requests(2, 8, max_tokens=8)
    low.priority, high.priority = 3, 0
    sched.add_request(low)
    run_step(sched)  # low prefilled, 9 tokens
    sched.add_request(high)
    assert plan(run_step(sched)) == [("r0", 1), ("r1", 8)]  # every block in use now
    out = run_step(sched)  # high's first decode needs a block: low goes, not the newest
    assert out.preempted == ["r0"] and plan(out) == [("r1", 1)]
    assert sched.waiting[0] is low and low.status is RequestStatus.WAITING
    assert high.status is RequestStatus.RUNNING


def test_fcfs_takes_no_notice_of_priority_and_an_unknown_policy_is_refused() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=1)
    low, high = make_requests(2, 4, max_tokens=2)
    low.priority, high.priority = 9, -9
    sched.add_request(low)
    sched.add_request(high)
    assert plan(run_step(sched)) == [("r0", 4)]
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority"):
        make_scheduler(policy="lifo")
