"""A simulated disaggregated fleet: router, prefill pool, decode pool, and a controller that
resizes the pools every interval; a trace goes in, per-request latencies and GPU-seconds out.

What is exact and what is approximated:
- Prefill: each replica serves its prompts first come, first served, one at a time, taking
  `curves.prefill_s(n)`; the router sends a prompt on arrival to the serving replica that is
  free soonest. Start and finish times are exact (no time step). The first token leaves the
  prefill replica, so TTFT = prefill finish - arrival.
- Hand-off: the KV still in flight after the first token takes `curves.handoff_s(n)` (streamed
  chunk by chunk during the prefill: the last chunk's, or the backlog of a slow link); then the
  request waits in one FIFO queue (with `curves.first_token_waits_for_kv` the first token is
  held until the KV has landed: the tail counts against TTFT instead of TPOT)
  for any decode replica with a free batch slot and room for its prompt's KV now (the least
  filled one). As the batch grows past the KV cache, the newest requests are preempted (as
  our engine does) and queue again first, after a recompute delay.
- Decode: time-stepped (`dt`), fluid within a step: every request of a replica's batch gains
  one token per decode step, the step lasting `curves.decode_step_s(batch, kv_tokens)` as of the
  start of the tick. A request finishes when its steps reach output - 1 (exact time
  interpolated inside the tick). TPOT = (finish - first token) / (output - 1), so waiting for a
  decode slot after the first token counts against TPOT, as it does on the real fleet.
- Phase boundary (`boundary`, None: every prompt is prefilled remotely): the decode replica the
  router would pick (the least loaded) prefills a prompt itself when `PhaseBoundary.remote`
  says so, given the least busy prefill replica's backlog (seconds until it is free), the
  prompt tokens this replica already holds unprefilled, its current step time (as its
  recent inter-token latency), the prompt's prefill_s and the mean answer of the requests
  so far. Such a replica runs the engine's mixed steps: its batch decodes
  one token per step while a chunk of the oldest local prompt (the step's token budget less
  the batch) is prefilled; a step lasts decode_step_s + a + what the chunk adds to its prompt's
  prefill_s - min(a, d0), as in aggregated_sim. The step that ends a prompt gives its first
  token; the request then decodes in that batch with no hand-off.
- Late prompts last (`late_after_s`, the TTFT target; None: first come, first served), as the
  engine's scheduler does: a prompt that would wait longer than `late_after_s` for a prefill
  replica (it misses the target anyway) waits instead until one is idle, oldest first, so the
  prompts that can still meet the target go ahead of it; after `late_limit_s` waiting it is
  queued in its turn on the replica free soonest.
- Prefix cache (`prefix`, None: not modelled; plan/prefix_cache.py): each prefill replica keeps
  the blocks of the prompts it prefilled (and a host tier of them); a prompt's prefix found
  there is not computed (its KV is sent at once, ahead of the computed chunks'); the router
  picks the prefill replica by its own ranking under either policy (`least-loaded` or
  `prefix-aware`), a replica's backlog being its open prompts' tokens still to compute (the
  one it is computing counted down as it goes, as the engine's gauge falls), so the two
  policies are compared on the same footing. Without the prefix cache modelled, a prompt goes
  to the replica free soonest: a balancer that knows each queue's time exactly. The decode
  replicas' caches (whose hits the hand-off skips) are not modelled.
- Replicas: a new one serves `curves.startup_s` after it is asked for; GPU-seconds count from
  the ask. Scale-down cancels starting replicas first, then drains the least loaded: a draining
  replica takes no new work and stops when its last request is done; no request is lost.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from phasefleet.api.boundary import LocalLoad, PhaseBoundary
from phasefleet.api.contract import DEFAULT_LATE_LIMIT_S
from phasefleet.autoscale.peaks import WindowPeak
from phasefleet.plan.curves import Curves
from phasefleet.plan.prefix_cache import PrefixCaching, PrefixModel, ReplicaCache
from phasefleet.plan.trace import Trace
from phasefleet.router.policy import Candidate, WorkerLoad, rank_prefill

POOLS = ("prefill", "decode")


@dataclass
class Replica:
    started: float  # asked for (GPU time counts from here)
    ready_at: float  # serves from here
    stopped: float | None = None
    draining: bool = False
    free_at: float = 0.0  # prefill: when its queue empties
    # decode: the batch, as a heap of (target step count, request index), and its sums
    batch: list[tuple[float, int]] = field(default_factory=list)
    steps: float = 0.0  # decode steps done since start (fractional)
    prompt_sum: float = 0.0  # KV tokens = prompt_sum + len(batch) * steps - start_sum
    start_sum: float = 0.0
    busy_s: float = 0.0  # decode: seconds with a non-empty batch
    # decode: prompts it prefills itself, oldest first: [request, tokens still to prefill]
    local: deque[list[float]] = field(default_factory=deque)
    local_tokens: float = 0.0  # their tokens still to prefill
    local_kv: float = 0.0  # their whole prompts, reserved in the KV cache
    # decode: the worker's peak gauges, KV tokens (not yet a share) and requests held
    kv_peak: WindowPeak = field(default_factory=WindowPeak)
    requests_peak: WindowPeak = field(default_factory=WindowPeak)
    name: str = ""  # the router's name for it
    cache: ReplicaCache | None = None  # prefill, with the prefix cache modelled
    # prefill, with the prefix cache modelled: (start, finish, tokens to compute) of its open
    # prompts, the first of which computes from start to finish
    open: deque[tuple[float, float, float]] = field(default_factory=deque)

    def serving(self, now: float) -> bool:
        return self.stopped is None and not self.draining and self.ready_at <= now

    def kv_tokens(self) -> float:
        return self.prompt_sum + len(self.batch) * self.steps - self.start_sum

    def load(self) -> float:
        """KV held and reserved: what the router balances decode replicas on."""
        return self.kv_tokens() + self.local_kv


# desired replicas per pool, from the fleet as it is now (the controller reads what it needs)
Controller = Callable[["Fleet", float], Mapping[str, int]]


@dataclass
class Sample:
    """The fleet at one decision time, for plots."""

    time: float
    asked: dict[str, int]  # replicas asked for, starting included
    serving: dict[str, int]


class Fleet:
    """The simulated fleet and the trace's per-request results (NaN until known)."""

    def __init__(
        self,
        trace: Trace,
        curves: Curves,
        initial: Mapping[str, int],
        dt: float,
        boundary: PhaseBoundary | None = None,
        tpot_target_s: float | None = None,
        late_after_s: float | None = None,
        late_limit_s: float = DEFAULT_LATE_LIMIT_S,
        prefix: PrefixCaching | None = None,
    ) -> None:
        self.trace, self.curves, self.dt = trace, curves, dt
        self.prefix = (
            None
            if prefix is None
            else PrefixModel(trace, prefix, curves.kv_capacity_tokens, curves.kv_bytes_per_token)
        )
        self.named = 0  # replicas made so far
        self.boundary, self.tpot_target_s = boundary, tpot_target_s
        self.late_after_s, self.late_limit_s = late_after_s, late_limit_s
        self.late: deque[int] = deque()  # prompts waiting for an idle prefill replica
        self.deferred: list[int] = []  # the prompts that waited there
        self.local_prefills = 0  # requests a decode replica prefilled itself
        self.output_sums = np.cumsum(trace.output)
        n = len(trace.arrival)
        self.prefill_start = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.pools: dict[str, list[Replica]] = {p: [] for p in POOLS}  # not stopped
        self.retired: list[Replica] = []
        self.done = 0  # requests finished
        self.end = 0.0  # the last request's finish, once the replay is over
        for pool in POOLS:
            for _ in range(initial[pool]):
                self.pools[pool].append(self._replica(pool, 0.0, 0.0))
        self.handoffs: list[tuple[float, int]] = []  # (ready for decode, request)
        self.decode_queue: deque[tuple[float, int]] = deque()
        self.generated = 0.0  # decode tokens produced so far
        self.generated_before = np.zeros(n)  # tokens a preempted request had made
        self.preemptions = 0
        self.samples: list[Sample] = []
        self.scale_events = {p: 0 for p in POOLS}
        # requests handed off and not yet in a batch: the decode pool's waiting, as a gauge's
        # peak (the engines' waiting queues in a real fleet)
        self.queue_peak = WindowPeak()

    def _replica(self, pool: str, started: float, ready_at: float) -> Replica:
        self.named += 1
        r = Replica(started=started, ready_at=ready_at, name=f"{pool}-{self.named}")
        if pool == "prefill" and self.prefix is not None:
            r.cache = self.prefix.new_cache()
        return r

    def asked(self, pool: str) -> list[Replica]:
        return [r for r in self.pools[pool] if r.stopped is None and not r.draining]

    def serving(self, pool: str, now: float) -> list[Replica]:
        return [r for r in self.pools[pool] if r.serving(now)]

    def resize(self, pool: str, desired: int, now: float) -> None:
        live = self.asked(pool)
        if desired > len(live):
            for _ in range(desired - len(live)):
                r = self._replica(pool, now, now + self.curves.startup_s)
                r.free_at = r.ready_at
                self.pools[pool].append(r)
        elif desired < len(live):
            starting = [r for r in live if r.ready_at > now]
            ready = [r for r in live if r.ready_at <= now]
            load: Callable[[Replica], float] = (
                (lambda r: r.free_at) if pool == "prefill" else (lambda r: r.load())
            )
            for r in (starting[::-1] + sorted(ready, key=load))[: len(live) - desired]:
                if r.ready_at > now:
                    r.stopped = now  # cancelled while loading
                else:
                    r.draining = True
        if desired != len(live):
            self.scale_events[pool] += 1

    def arrive(self, i: int) -> None:
        t = float(self.trace.arrival[i])
        candidates = self.serving("prefill", t) or self.asked("prefill")
        if not candidates:  # no prefill replica at all: one is started (cannot happen with min 1)
            self.resize("prefill", 1, t)
            candidates = self.asked("prefill")
        r = self._route_prefill(i, t, candidates)
        if self.boundary is not None and self._prefill_here(i, t, max(0.0, r.free_at - t)):
            return
        if self.late_after_s is not None and r.free_at - t > self.late_after_s:
            self.late.append(i)
            self.deferred.append(i)
            # pending, and not started: what the signals count as a waiting prompt
            self.prefill_start[i] = self.first_token[i] = math.inf
            return
        self._prefill_on(r, i, max(t, r.free_at))

    def _route_prefill(self, i: int, t: float, candidates: list[Replica]) -> Replica:
        """The replica free soonest; with the prefix cache modelled, the router's own choice
        under its policy, over the replicas' backlogs."""
        if self.prefix is None:
            return min(candidates, key=lambda r: r.free_at)
        loads = []
        for r in candidates:
            while r.open and r.open[0][1] <= t:
                r.open.popleft()
            pending = sum(tokens for _, _, tokens in r.open)
            if r.open and r.open[0][0] < t:  # the engine's gauge falls as its chunks compute
                begin, end, tokens = r.open[0]
                pending -= tokens * (t - begin) / (end - begin)
            loads.append(Candidate(r.name, WorkerLoad(len(r.open), 0.0, 0.0, pending, 0.0), 0))
        policy = "prefix-aware" if self.prefix.caching.prefix_aware else "least-loaded"
        name = rank_prefill(policy, loads, i, self.prefix.matched(i))[0]
        self.prefix.routed_to(i, name)
        return next(r for r in candidates if r.name == name)

    def _prefill_on(self, r: Replica, i: int, start: float) -> None:
        n = float(self.trace.prompt[i])
        cached = load_s = 0.0
        if self.prefix is not None and r.cache is not None:
            cached, load_s = self.prefix.admit(r.cache, i, n)
        r.free_at = start + load_s + self.curves.prefill_s(n, cached)
        if r.cache is not None:
            r.open.append((start, r.free_at, n - cached))
        self.prefill_start[i], self.first_token[i] = start, r.free_at
        if self.trace.output[i] <= 1:
            self.finish[i] = r.free_at
            self.done += 1
        else:
            landed = r.free_at + self.curves.handoff_s(n, cached)
            if self.curves.first_token_waits_for_kv:
                self.first_token[i] = landed
            heapq.heappush(self.handoffs, (landed, i))

    def serve_late(self, t: float) -> None:
        """The late prompts, oldest first: those that waited `late_limit_s` queued in their
        turn, then the others on the prefill replicas idle at `t`."""
        while self.late and t - self.trace.arrival[self.late[0]] >= self.late_limit_s:
            candidates = self.serving("prefill", t)
            if not candidates:
                return
            r = min(candidates, key=lambda r: r.free_at)
            self._prefill_on(r, self.late.popleft(), max(t, r.free_at))
        while self.late:
            idle = next((r for r in self.serving("prefill", t) if r.free_at <= t), None)
            if idle is None:
                return
            self._prefill_on(idle, self.late.popleft(), t)

    def _prefill_here(self, i: int, t: float, backlog_s: float) -> bool:
        """Queues request i's prompt on the least loaded decode replica if the boundary says
        so; False: it goes to the prefill pool."""
        assert self.boundary is not None
        decoders = self.serving("decode", t)
        if not decoders:
            return False
        d = min(decoders, key=lambda r: r.load())
        n = float(self.trace.prompt[i])
        answer = float(self.output_sums[i]) / (i + 1)  # the mean answer so far
        busy = len(d.batch) + len(d.local)
        local = LocalLoad(
            int(d.local_tokens),
            self._mixed_step(d)[0],  # its step now: the recent inter-token latency
            self.tpot_target_s,
            self.curves.prefill_s(n),
            answer,
            busy,
        )
        if self.boundary.remote(int(n), backlog_s, local):
            return False
        d.local.append([float(i), n])
        d.local_tokens += n
        d.local_kv += n
        self.prefill_start[i] = t
        self.local_prefills += 1
        return True

    def _mixed_step(self, r: Replica) -> tuple[float, float]:
        """(step seconds, prompt tokens the step prefills) for the replica as it is now."""
        c = self.curves
        b = len(r.batch)
        decode = c.decode_step_s(b, r.kv_tokens()) if b else 0.0
        if not r.local:
            return decode, 0.0
        i, remaining = r.local[0]
        total = float(self.trace.prompt[int(i)])
        chunk = min(max(1.0, c.chunk_tokens - b), remaining)
        done = total - remaining
        a, d0 = c.prefill[0], c.decode[0]
        added = c.prefill_s(done + chunk) - c.prefill_s(done)
        return decode + a + added - (min(a, d0) if b else 0.0), chunk

    def decode_tick(self, t: float) -> None:
        dt, c = self.dt, self.curves
        while self.handoffs and self.handoffs[0][0] < t + dt:
            self.decode_queue.append(heapq.heappop(self.handoffs))
        ready = self.serving("decode", t)
        while self.decode_queue and ready:
            at, i = self.decode_queue[0]
            done_before = self.generated_before[i]
            size = float(self.trace.prompt[i] + done_before)  # KV it brings in
            fits = [
                r
                for r in ready
                if len(r.batch) < c.max_num_seqs and r.load() + size <= c.kv_capacity_tokens
            ]
            if not fits:
                break
            self.decode_queue.popleft()
            r = min(fits, key=lambda r: r.load())
            step = c.decode_step_s(len(r.batch) + 1, r.kv_tokens())
            # joins part-way through the tick; a preempted request keeps the tokens it had
            begin = r.steps + max(0.0, at - t) / step - done_before
            heapq.heappush(r.batch, (begin + float(self.trace.output[i] - 1), i))
            r.prompt_sum += self.trace.prompt[i]
            r.start_sum += begin
        for r in ready:  # after admissions, as the engine observes after scheduling
            r.kv_peak.observe(r.kv_tokens() + r.local_kv, t)
            r.requests_peak.observe(len(r.batch) + len(r.local), t)
        self.queue_peak.observe(len(self.decode_queue), t)
        for pool in POOLS:
            for r in self.pools[pool]:
                if r.stopped is None and r.ready_at <= t:
                    self._advance(pool, r, t)
            if any(r.stopped is not None for r in self.pools[pool]):
                for r in self.pools[pool]:
                    if r.stopped is not None and self.prefix is not None:
                        self.prefix.forget(r.name)
                self.retired += [r for r in self.pools[pool] if r.stopped is not None]
                self.pools[pool] = [r for r in self.pools[pool] if r.stopped is None]

    def _advance(self, pool: str, r: Replica, t: float) -> None:
        if pool == "prefill":
            if r.draining and r.free_at <= t:
                r.stopped = max(r.free_at, r.ready_at)
            return
        if not r.batch and not r.local:
            if r.draining:
                r.stopped = t
            return
        r.busy_s += self.dt
        now, left = t, self.dt
        # segments of equal steps: to the end of the tick, or to the end of a local prompt
        while left > 1e-12 and (r.batch or r.local):
            step, chunk = self._mixed_step(r)
            seg = min(left, r.local[0][1] / chunk * step) if chunk else left
            arrives = self.prefill_start[int(r.local[0][0])] if r.local else now
            if arrives > now:  # the oldest local prompt arrived within this tick
                step = self.curves.decode_step_s(len(r.batch), r.kv_tokens())
                seg, chunk = min(left, arrives - now), 0.0
            self._decode_for(r, now, seg, step)
            now, left = now + seg, left - seg
            if chunk:
                head = r.local[0]
                made = min(head[1], seg / step * chunk)
                head[1] -= made
                r.local_tokens -= made
                if head[1] <= 1e-9:
                    self._prefilled_here(r, now)

    def _decode_for(self, r: Replica, now: float, seg: float, step: float) -> None:
        """`seg` seconds of steps lasting `step` from `now`: every request of the batch gains a
        token a step; those reaching their output finish."""
        if not r.batch:
            return
        end = r.steps + seg / step
        self.generated += len(r.batch) * seg / step
        self._preempt(r, end, now)
        while r.batch and r.batch[0][0] <= end:
            target, i = heapq.heappop(r.batch)
            self.finish[i] = now + (target - r.steps) * step
            self.done += 1
            r.prompt_sum -= self.trace.prompt[i]
            r.start_sum -= target - (self.trace.output[i] - 1)
        r.steps = end
        if not r.batch:  # keep the sums exact when the batch empties
            r.prompt_sum = r.start_sum = 0.0

    def _prefilled_here(self, r: Replica, now: float) -> None:
        """The oldest local prompt's last chunk ended at `now`: its first token; it decodes in
        this replica's batch from the next step."""
        i = int(r.local.popleft()[0])
        n = float(self.trace.prompt[i])
        r.local_kv -= n
        if not r.local:
            r.local_tokens = r.local_kv = 0.0
        self.first_token[i] = now
        if self.trace.output[i] <= 1:
            self.finish[i] = now
            self.done += 1
            return
        heapq.heappush(r.batch, (r.steps + float(self.trace.output[i] - 1), i))
        r.prompt_sum += n
        r.start_sum += r.steps

    def _preempt(self, r: Replica, end: float, t: float) -> None:
        """KV full before `end` steps: the newest requests leave the batch, as the engine
        preempts them, and queue again first in line after recomputing their KV (a delay of
        prefill_s(prompt + tokens so far), charged to the request alone)."""
        while len(r.batch) > 1 and r.prompt_sum + len(r.batch) * end - r.start_sum > (
            self.curves.kv_capacity_tokens
        ):
            out = self.trace.output
            newest = max(range(len(r.batch)), key=lambda k: r.batch[k][0] - out[r.batch[k][1]])
            target, i = r.batch.pop(newest)
            heapq.heapify(r.batch)
            begin = target - (out[i] - 1)
            self.generated_before[i] = max(0.0, r.steps - begin)
            r.prompt_sum -= self.trace.prompt[i]
            r.start_sum -= begin
            redo = self.curves.prefill_s(self.trace.prompt[i] + self.generated_before[i])
            self.decode_queue.appendleft((t + self.dt + redo, i))
            self.preemptions += 1

    def gpu_seconds(self, end: float) -> float:
        live = [r for pool in POOLS for r in self.pools[pool]]
        return sum((end if r.stopped is None else r.stopped) - r.started for r in live) + sum(
            (r.stopped or end) - r.started for r in self.retired
        )


def simulate(
    trace: Trace,
    curves: Curves,
    controller: Controller,
    initial: Mapping[str, int],
    interval_s: float = 15.0,
    dt: float = 0.05,
    boundary: PhaseBoundary | None = None,
    tpot_target_s: float | None = None,
    late_after_s: float | None = None,
    late_limit_s: float = DEFAULT_LATE_LIMIT_S,
    prefix: PrefixCaching | None = None,
) -> Fleet:
    """Replays `trace` to its last token; `controller` runs every `interval_s` from 0.
    `boundary`: which prompts decode replicas prefill themselves (None: none do);
    `tpot_target_s`: the target its room check holds them to; `late_after_s`: late prompts
    last (see the module's docstring; None: first come, first served); `prefix`: the prefill
    replicas' prefix cache (None: not modelled)."""
    fleet = Fleet(
        trace, curves, initial, dt, boundary, tpot_target_s, late_after_s, late_limit_s, prefix
    )
    n, i, tick = len(trace.arrival), 0, 0
    next_decision = 0.0
    while fleet.done < n:
        t = tick * dt
        if t >= next_decision:
            desired = controller(fleet, t)
            for pool in POOLS:
                fleet.resize(pool, desired[pool], t)
            fleet.samples.append(
                Sample(
                    t,
                    {p: len(fleet.asked(p)) for p in POOLS},
                    {p: len(fleet.serving(p, t)) for p in POOLS},
                )
            )
            next_decision += interval_s
        fleet.serve_late(t)
        while i < n and trace.arrival[i] < t + dt:
            fleet.arrive(i)
            i += 1
        fleet.decode_tick(t)
        tick += 1
        if t > trace.duration + 6 * 3600:
            raise RuntimeError(
                f"{trace.name}: requests still unfinished 6 h after the last arrival"
            )
    fleet.end = float(np.max(fleet.finish)) if n else 0.0
    return fleet


def ceil_div(a: float, b: float) -> int:
    return max(0, math.ceil(a / b - 1e-9))
