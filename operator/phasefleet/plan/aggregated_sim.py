"""A simulated aggregated fleet: N identical workers that each prefill and decode, behind a
router; a trace goes in, per-request first token and finish times and GPU-seconds out, as from
the disaggregated `autoscale_sim.Fleet`, so the same scoring reads both.

Each worker runs our engine's step schedule (runtime_image/phasefleet/engine/scheduler.py),
one step after another with no time grid:
- every running request past its prefill decodes one token; the rest of the step's token
  budget B (`chunk_tokens`) goes to prefill chunks, first of the requests already admitted
  (oldest first), then of requests admitted from the waiting queue (first come, first served)
  while a batch slot is free (`max_num_seqs`) and the KV cache has room for the whole prompt;
  no admission in a step that preempted. Unchunked is the same with B = the model's context:
  a prompt's whole prefill is one step, and the decodes beside it wait for that step.
- The step that computes a prompt's last token gives its first token (TTFT is that step's end
  minus the arrival); then one token per step; TPOT = (finish - first token) / (output - 1).
- KV: a request holds prompt + tokens so far. When the decodes of the next step do not fit,
  the newest running request is preempted (as the engine does, and as autoscale_sim does for
  its decode pool): it goes back to the front of the queue and its prompt and the tokens it
  had are prefilled again through the same steps; the step that ends that recompute makes its
  next token.

Step time, from the curves (prefill_s(n) = a + b n + c n^2, decode_step_s(B, K) = d0 + d1 B +
d2 K), for `n_dec` decodes holding `kv_dec` KV tokens and chunks j of c_j tokens starting at
position p_j of their prompt:

    step_s = [n_dec > 0] decode_step_s(n_dec, kv_dec)
           + [any chunk] (a + sum_j (prefill_s(p_j + c_j) - prefill_s(p_j)))
           - [both] min(a, d0)

A chunk costs what its tokens add to its prompt's prefill (later chunks attend to more KV);
a step pays one fixed overhead, so a mixed step drops the smaller of the two (on the 8B/H100
curves a = the 4 ms step overhead, which d0 contains). A prompt alone takes prefill_s(n) in
one step; chunked, it pays a per chunk.

Router: each arrival goes to the worker holding the fewest tokens of work (KV allocated to its
running requests + prompt tokens waiting for admission), ties to the next worker in turn: a
balancer that knows every worker's work exactly.
Decode-only stretches (no prefill chunk possible) are jumped in closed form to the next
finish, arrival or KV limit, so an hour of a trace runs in seconds.

Prefix cache (`prefix`, None: not modelled; plan/prefix_cache.py): each worker keeps the blocks
of the prompts it admitted (and a host tier of them); an admitted prompt's prefix found there is
not computed (its first chunk starts after it; loading the host part lengthens the step), and
the router is the router's own code under either policy (`least-loaded` or `prefix-aware`),
ranking the workers on what their gauges would report (running and waiting requests, KV use,
prompt tokens not yet computed), so the two policies are compared on the same footing.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from phasefleet.plan.curves import Curves
from phasefleet.plan.prefix_cache import PrefixCaching, PrefixModel, ReplicaCache
from phasefleet.plan.trace import Trace
from phasefleet.router.policy import Candidate, WorkerLoad, rank_least_loaded, rank_prefix_aware


@dataclass
class Prefill:
    request: int
    done: int  # tokens computed
    total: int  # prompt + the output tokens it had (recomputed after a preemption)


@dataclass
class Worker:
    """One aggregated worker: its clock, its running requests by phase and its queue."""

    clock: float = 0.0  # when its next step may start
    steps: int = 0  # steps run; a decoding request made one token in each since it joined
    decoding: list[tuple[int, int]] = field(default_factory=list)  # heap (finish step, request)
    dec_prompt_sum: int = 0  # KV of the decodes = dec_prompt_sum + len * steps - dec_start_sum
    dec_start_sum: int = 0
    prefilling: list[Prefill] = field(default_factory=list)  # admission order
    prefill_kv: int = 0  # KV allocated to the prefilling requests (whole prompts)
    waiting: deque[int] = field(default_factory=deque)
    waiting_tokens: int = 0
    cache: ReplicaCache | None = None  # with the prefix cache modelled

    def kv_decoding(self) -> int:
        return self.dec_prompt_sum + len(self.decoding) * self.steps - self.dec_start_sum

    def kv_held(self) -> int:
        return self.kv_decoding() + self.prefill_kv

    def load(self) -> int:
        return self.kv_held() + self.waiting_tokens

    def running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    def report(self, kv_capacity: int) -> WorkerLoad:
        """What the engine's gauges would say: running and waiting requests, KV use, prompt
        tokens admitted and not yet computed, and those queued."""
        pending = sum(p.total - p.done for p in self.prefilling)
        return WorkerLoad(
            self.running(),
            len(self.waiting),
            self.kv_held() / kv_capacity,
            float(pending),
            float(self.waiting_tokens),
        )

    def idle(self) -> bool:
        return not (self.decoding or self.prefilling or self.waiting)


class AggregatedFleet:
    """`workers` aggregated workers serving `trace`; per-request results (NaN until known)."""

    def __init__(
        self, trace: Trace, curves: Curves, workers: int, prefix: PrefixCaching | None = None
    ) -> None:
        c = curves
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if c.chunk_tokens <= c.max_num_seqs:
            raise ValueError(
                f"chunk_tokens ({c.chunk_tokens}) must exceed max_num_seqs ({c.max_num_seqs}): "
                "a full batch of decodes would leave no budget for prefill"
            )
        biggest = int((trace.prompt + trace.output).max()) if len(trace.prompt) else 0
        if biggest > c.kv_capacity_tokens:
            raise ValueError(
                f"{trace.name}: a request of {biggest} tokens exceeds kv_capacity_tokens "
                f"({c.kv_capacity_tokens}); shorten the trace's requests"
            )
        self.trace, self.curves = trace, curves
        n = len(trace.arrival)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.made = np.zeros(n, np.int64)  # output tokens so far
        self.admitted_at = np.zeros(n, np.int64)  # admission order, for preemption
        self.admissions = 0
        self.preemptions = 0
        self.workers = [Worker() for _ in range(workers)]
        self.prefix = (
            None
            if prefix is None
            else PrefixModel(trace, prefix, c.kv_capacity_tokens, c.kv_bytes_per_token)
        )
        for w in self.workers:
            w.cache = None if self.prefix is None else self.prefix.new_cache()
        self.end = 0.0  # the last request's finish, once the replay is over

    def gpu_seconds(self, end: float) -> float:
        return len(self.workers) * end

    def route(self, i: int) -> Worker:
        n = len(self.workers)
        if self.prefix is None:
            k = min(range(n), key=lambda k: (self.workers[k].load(), (k - i) % n))
            return self.workers[k]
        capacity = self.curves.kv_capacity_tokens
        loads = [Candidate(str(k), w.report(capacity), 0) for k, w in enumerate(self.workers)]
        if self.prefix.caching.prefix_aware:
            name = rank_prefix_aware(loads, i, self.prefix.matched(i))[0]
        else:
            name = rank_least_loaded(loads, i)[0]
        self.prefix.routed_to(i, name)
        return self.workers[int(name)]

    def arrive(self, i: int) -> None:
        t = float(self.trace.arrival[i])
        for w in self.workers:
            self.advance(w, t)
        w = self.route(i)
        if w.idle():
            w.clock = max(w.clock, t)
        w.waiting.append(i)
        w.waiting_tokens += int(self.trace.prompt[i])

    def advance(self, w: Worker, until: float) -> None:
        """Runs the steps that start before `until`."""
        while not w.idle() and w.clock < until:
            if not self._decode_stretch(w, until):
                self._step(w)

    def _admissible(self, w: Worker, kv_after_decodes: int) -> bool:
        if not w.waiting or w.running() >= self.curves.max_num_seqs:
            return False
        i = w.waiting[0]
        need = int(self.trace.prompt[i] + self.made[i])
        return kv_after_decodes + w.prefill_kv + need <= self.curves.kv_capacity_tokens

    def _decode_stretch(self, w: Worker, until: float) -> bool:
        """Decode-only steps, run at once up to the next finish, `until` or the KV limit;
        False if the next step has a prefill chunk or must preempt."""
        c, n = self.curves, len(w.decoding)
        kv = w.kv_decoding()
        if w.prefilling or not n or self._admissible(w, kv + n):
            return False
        room = (c.kv_capacity_tokens - kv) // n
        m = min(w.decoding[0][0] - w.steps, room)
        if m < 1:
            return False
        d0, d1, d2 = c.decode
        first = d0 + d1 * n + d2 * kv  # each later step is `grow` longer (one more KV token each)
        grow = d2 * n
        left = until - w.clock

        def span(k: int) -> float:  # seconds of k steps
            return k * first + grow * k * (k - 1) / 2

        if span(m - 1) >= left:  # only the k steps that start before `until`: span(k - 1) < left
            if grow:  # span(root) = left
                half = first - grow / 2
                root = (math.sqrt(half * half + 2 * grow * left) - half) / grow
            else:
                root = left / first
            m = max(1, min(m, math.ceil(root)))
            while m > 1 and span(m - 1) >= left:
                m -= 1
        w.steps += m
        w.clock += span(m)
        self._finish_decodes(w)
        return True

    def _finish_decodes(self, w: Worker) -> None:
        out = self.trace.output
        while w.decoding and w.decoding[0][0] <= w.steps:
            target, i = heapq.heappop(w.decoding)
            self.finish[i] = w.clock
            self.made[i] = out[i]
            w.dec_prompt_sum -= int(self.trace.prompt[i])
            w.dec_start_sum -= target - int(out[i] - 1)

    def _preempt_newest(self, w: Worker) -> None:
        newest = max(
            [i for _, i in w.decoding] + [p.request for p in w.prefilling],
            key=lambda i: self.admitted_at[i],
        )
        if any(p.request == newest for p in w.prefilling):
            k = next(k for k, p in enumerate(w.prefilling) if p.request == newest)
            w.prefill_kv -= w.prefilling.pop(k).total
        else:
            k = next(k for k, (_, i) in enumerate(w.decoding) if i == newest)
            target, _ = w.decoding.pop(k)
            heapq.heapify(w.decoding)
            start = target - int(self.trace.output[newest] - 1)
            self.made[newest] = 1 + w.steps - start
            w.dec_prompt_sum -= int(self.trace.prompt[newest])
            w.dec_start_sum -= start
        w.waiting.appendleft(newest)
        w.waiting_tokens += int(self.trace.prompt[newest] + self.made[newest])
        self.preemptions += 1

    def _step(self, w: Worker) -> None:
        c, tr = self.curves, self.trace
        a, b, q = c.prefill
        preempted = False
        while w.decoding and w.kv_decoding() + len(w.decoding) + w.prefill_kv > (
            c.kv_capacity_tokens
        ):
            self._preempt_newest(w)
            preempted = True
        n = len(w.decoding)
        kv = w.kv_decoding()
        budget = c.chunk_tokens - n
        chunk_s = 0.0
        chunks = 0
        for p in w.prefilling:
            if budget == 0:
                break
            take = min(p.total - p.done, budget)
            chunk_s += b * take + q * ((p.done + take) ** 2 - p.done**2)
            p.done += take
            budget -= take
            chunks += 1
        while not preempted and budget > 0 and self._admissible(w, kv + n):
            i = w.waiting.popleft()
            total = int(tr.prompt[i] + self.made[i])
            w.waiting_tokens -= total
            self.admitted_at[i] = self.admissions
            self.admissions += 1
            found = 0.0
            if self.prefix is not None and w.cache is not None:
                found, load_s = self.prefix.admit(w.cache, i, total)
                chunk_s += load_s
            take = min(total - int(found), budget)
            chunk_s += b * take + q * ((found + take) ** 2 - found**2)
            w.prefilling.append(Prefill(i, int(found) + take, total))
            w.prefill_kv += total
            budget -= take
            chunks += 1
        seconds = c.decode_step_s(n, kv) if n else 0.0
        if chunks:
            seconds += a + chunk_s - (min(a, c.decode[0]) if n else 0.0)
        w.clock += seconds
        w.steps += 1
        self._finish_decodes(w)
        for p in [p for p in w.prefilling if p.done == p.total]:
            self._prefilled(w, p)

    def _prefilled(self, w: Worker, p: Prefill) -> None:
        i = p.request
        w.prefilling.remove(p)
        w.prefill_kv -= p.total
        self.made[i] += 1
        if self.made[i] == 1:
            self.first_token[i] = w.clock
        out = int(self.trace.output[i])
        if self.made[i] >= out:
            self.finish[i] = w.clock
            return
        start = w.steps - int(self.made[i] - 1)
        heapq.heappush(w.decoding, (start + out - 1, i))
        w.dec_prompt_sum += int(self.trace.prompt[i])
        w.dec_start_sum += start


def simulate_aggregated(
    trace: Trace, curves: Curves, workers: int, prefix: PrefixCaching | None = None
) -> AggregatedFleet:
    """Replays `trace` on `workers` aggregated workers to its last token; `prefix`: their
    prefix cache (None: not modelled)."""
    fleet = AggregatedFleet(trace, curves, workers, prefix)
    for i in range(len(trace.arrival)):
        fleet.arrive(i)
    for w in fleet.workers:
        fleet.advance(w, math.inf)
    fleet.end = float(np.max(fleet.finish)) if len(trace.arrival) else 0.0
    return fleet
