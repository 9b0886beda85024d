"""Scheduler: decides, every step, which tokens of which requests the model computes.

One token budget per step (max_num_batched_tokens), spent in this order: running decodes, then
the unfinished prefill chunks of running requests, then requests from the waiting queue (first
come, first served; chunked when the budget runs out). A waiting request is admitted only when
blocks for its whole prompt are free. When a decode needs a new block and none is free, the
newest running request is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed (prompt plus the output so far) when it fits again.
With a host tier (engine/host_prefix_cache.py) prefix hits may continue in host memory: those
blocks are loaded, not computed, and the step's `kv_moves` carry the copies.

A decode with a draft (engine/speculation.py) takes 1 + len(draft) tokens of the budget: its
last known token and the guesses after it, verified in one pass. The draft is cut to the budget
and the model's length, and dropped when the pool has no blocks for it (it never preempts);
the accepted guesses' KV stays, the rest is overwritten by the next step.

With the `priority` policy the waiting queue is ordered by (priority, arrival): a lower value is
served first, arrival breaks ties (vLLM's meaning); a decode that needs a block preempts the
running request that is least urgent (highest value, latest arrival) instead of the newest, and
late prompts last is off (the priorities say what goes first).

Late prompts last (the service's TTFT target: a request's own `late_after_s`, which the router
sends, else the scheduler's; neither: first come, first served): a prompt that has waited
longer than that has missed the target already, so it moves to a late queue, admitted from only
in a step with no other prefill (nothing waiting, no running prompt unfinished), until it has
waited `late_limit_s`; then it goes back to the front. None is dropped. Through a burst more
prompts meet the target (bench/RESULTS.md, "Late prompts last").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from phasefleet.api.contract import DEFAULT_LATE_LIMIT_S, SCHEDULING_POLICIES
from phasefleet.engine.host_prefix_cache import KVMove
from phasefleet.engine.kv_cache_manager import KVCacheManager
from phasefleet.engine.request import Request, RequestStatus
from phasefleet.engine.speculation import accept


@dataclass
class ScheduledRequest:
    request: Request  # the request, state as of before this step
    start: int  # position of its first token computed this step (= num_computed_tokens)
    num_tokens: int  # tokens of it computed this step
    block_ids: list[int]  # its block table (live list, long enough for start + num_tokens)
    sample: bool  # this step reaches its last known token, so a new token is sampled
    draft: list[int] = field(default_factory=list)  # guessed tokens after its last known one,
    # the last len(draft) of num_tokens: verified this step (engine/speculation.py)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # batch order: decodes, prefill chunks, newly admitted
    num_batched_tokens: int  # sum of num_tokens over scheduled, <= max_num_batched_tokens
    preempted: list[str] = field(default_factory=list)  # ids evicted this step (recompute later)
    admitted: list[str] = field(default_factory=list)  # ids admitted from waiting this step
    # (request, first block to load) for admitted requests whose KV came with them: the engine
    # loads it into those blocks before the forward pass (earlier blocks were prefix-cache hits)
    imports: list[tuple[Request, int]] = field(default_factory=list)
    # copies between the pool and the host tier (host_prefix_cache.py), run in this order
    # before anything else writes to the pool: saves of evicted blocks, loads of host hits
    kv_moves: list[KVMove] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.admitted or self.preempted)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        late_after_s: float | None = None,
        late_limit_s: float = DEFAULT_LATE_LIMIT_S,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}"
            )
        self.policy = policy
        self.kv = kv
        self.late_after_s = late_after_s
        self.late_limit_s = late_limit_s
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting: deque[Request] = deque()
        # late prompts last: new prompts that waited past late_after_s, in arrival order;
        # admitted only in a step with no other prefill
        self.late: deque[Request] = deque()
        self.running: list[Request] = []  # admission order, oldest first
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.late_prompts_total = 0  # prompts moved behind on-time ones (each counted once)
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.host_cache_hits_total = 0  # of them, tokens loaded from host memory
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.draft_tokens_total = 0  # draft tokens verified (engine/speculation.py)
        self.accepted_tokens_total = 0  # of them, those the model agreed with

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        if self.policy == "fcfs":
            self.waiting.append(request)
        else:
            self._queue_by_priority(request)

    def _queue_by_priority(self, req: Request) -> None:
        """Into the waiting queue behind every request at least as urgent."""
        key = _urgency(req)
        at = len(self.waiting)
        while at > 0 and _urgency(self.waiting[at - 1]) > key:
            at -= 1
        self.waiting.insert(at, req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def prefill_tokens_pending(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.running if _prefilling(r))

    @property
    def prefill_tokens_waiting(self) -> int:
        """Tokens the queued requests will prefill once admitted (before prefix-cache hits,
        which are known only then; KV brought by a hand-off is not prefilled)."""
        return sum(
            r.num_tokens - max(r.num_computed_tokens, r.num_imported_tokens)
            for r in (*self.waiting, *self.late)
        )

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet, late ones included."""
        return len(self.waiting) + len(self.late)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], 0)

        ready = [r for r in self.running if not r.importing]
        decodes = [r for r in ready if not _prefilling(r)]
        prefills = [r for r in ready if _prefilling(r)]
        for i, req in enumerate(decodes):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an older (or more urgent) request
            if self._make_room(req, out):
                later = len(decodes) - i - 1  # their one token each goes before a draft
                self._add(out, req, 1, self._draft(req, budget - 1 - later, later))
            budget = self.max_num_batched_tokens - out.num_batched_tokens  # a victim's refunded

        for req in prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self._add(out, req, n)
            budget -= n

        if self.policy == "fcfs":
            self._late_last()
        while (
            (self.waiting or self.late)
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            # a late prompt only takes prefill capacity nothing else wants: once running, its
            # chunks would go ahead of the next on-time prompt's
            if not self.waiting and (prefills or out.admitted):
                break
            queue = self.waiting or self.late
            req = queue[0]
            hit = self.kv.find_prefix(req)
            if not self.kv.can_admit(req, hit):
                break
            queue.popleft()
            self.kv.admit(req, hit)
            req.status = RequestStatus.RUNNING
            gap = hit.num_blocks < req.import_first_block
            if gap:
                self._drop_import(req)  # a gap before the imported blocks: recompute
            req.num_computed_tokens = max(hit.num_tokens, req.num_imported_tokens)
            if not gap and (req.importing or req.num_imported_tokens > hit.num_tokens):
                out.imports.append((req, hit.num_blocks))
            self.prefix_cache_queries_total += req.num_tokens
            self.prefix_cache_hits_total += hit.num_tokens
            device_tokens = len(hit.block_ids) * self.kv.block_size
            self.host_cache_hits_total += max(0, hit.num_tokens - device_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
                req.num_cached_tokens = hit.num_tokens
                if not req.importing:  # else counted when the import ends
                    self.prompt_tokens_total += req.num_prompt_tokens - req.num_imported_tokens
            self.running.append(req)
            out.admitted.append(req.request_id)
            if req.importing:
                continue  # its blocks are reserved; computed once the import ends
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self._add(out, req, n)
            budget -= n
        out.kv_moves = self.kv.take_moves()  # with those of allocations since the last step
        return out

    def _late_last(self) -> None:
        """Moves the new prompts that waited past their target from the front of the waiting
        queue (arrival order, but for preempted requests there) to the late queue, and the
        late prompts that waited `late_limit_s` back to the front, oldest first. A prompt
        without a target counts as on time."""
        now, limit = self.clock(), self.late_limit_s
        expired: list[Request] = []
        while self.late and now - self.late[0].arrival_time >= limit:
            expired.append(self.late.popleft())
        kept: list[Request] = []  # requests ahead of the first on-time prompt, kept in place
        while self.waiting:
            req = self.waiting[0]
            waited = now - req.arrival_time
            late_after = self.late_after_s if req.late_after_s is None else req.late_after_s
            if _new_prompt(req) and (late_after is None or waited <= late_after):
                break  # on time, and so is everything that arrived after it
            self.waiting.popleft()
            if not _new_prompt(req) or waited >= limit:
                kept.append(req)
                continue
            self.late.append(req)  # once at most: it leaves admitted, or expired for good
            self.late_prompts_total += 1
        self.waiting.extendleft(reversed(expired + kept))

    def _make_room(self, req: Request, out: SchedulerOutput) -> bool:
        """Grow req's blocks by one token, preempting the newest requests (the least urgent
        under the priority policy: it may have been scheduled this step already, and is taken
        out of the step again); False if req itself was preempted."""
        while not self.kv.grow(req, req.num_computed_tokens + 1):
            victim = self.running[-1] if self.policy == "fcfs" else max(self.running, key=_urgency)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
            for s in [s for s in out.scheduled if s.request is victim]:
                out.scheduled.remove(s)
                out.num_batched_tokens -= s.num_tokens
        return True

    def _draft(self, req: Request, budget: int, keep_blocks: int) -> list[int]:
        """The part of a decode's draft this step verifies: what the budget, the model's length
        and the free blocks beyond `keep_blocks` (one for each later decode) allow; a draft
        never preempts, without room it waits a step."""
        draft = req.draft_token_ids[: max(0, min(budget, self.max_model_len - req.num_tokens))]
        req.draft_token_ids = []
        if not draft:
            return []
        end = req.num_computed_tokens + 1 + len(draft)
        needed = self.kv.blocks_needed(end) - len(self.kv.block_tables[req.request_id])
        if needed > self.kv.pool.num_free_blocks - keep_blocks or not self.kv.grow(req, end):
            return []
        return draft

    def _add(
        self, out: SchedulerOutput, req: Request, n: int, draft: list[int] | None = None
    ) -> None:
        """Schedules n known tokens of req, then its draft's."""
        start, draft = req.num_computed_tokens, draft or []
        out.scheduled.append(
            ScheduledRequest(
                request=req,
                start=start,
                num_tokens=n + len(draft),
                block_ids=self.kv.block_tables[req.request_id],
                sample=start + n == req.num_tokens,
                draft=draft,
            )
        )
        out.num_batched_tokens += n + len(draft)

    def end_import(self, req: Request, first_token_id: int | None = None) -> None:
        """No more KV comes for an importing request: it goes on from the last token whose
        KV arrived (the rest of the prompt is recomputed), after `first_token_id` when the
        prefill worker sent one (else it samples its first token here)."""
        if not req.importing:
            return
        req.importing = False
        if first_token_id is not None:
            req.output_token_ids.append(first_token_id)
        if req.first_scheduled_time is not None:
            self.prompt_tokens_total += req.num_prompt_tokens - req.num_imported_tokens
        if req.status is RequestStatus.RUNNING:
            known = max(req.num_computed_tokens, req.num_imported_tokens)
            req.num_computed_tokens = min(known, req.num_tokens - 1)  # one left to sample from
            if not self.kv.grow(req, req.num_tokens):  # the first token's slot: none is free
                self._preempt(req)

    def _drop_import(self, req: Request) -> None:
        """The imported KV will not be used: the request recomputes its prompt (once its
        import ends, if it is still importing: the first token may be on its way)."""
        req.num_imported_tokens = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        self._drop_import(req)  # the imported KV went with the blocks: recompute it
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.policy == "fcfs":
            self.waiting.appendleft(req)
        else:
            self._queue_by_priority(req)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        verified: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Apply one step's results; returns the requests that got new tokens, in batch order
        (finished ones have status FINISHED and their blocks freed). `verified`: for each
        request with a draft, the token drawn at each of its positions but the last (`sampled`
        holds the last)."""
        changed = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            known = s.start + s.num_tokens - len(s.draft)  # computed, before any draft token
            if not s.sample or req.embed:
                req.num_computed_tokens = known
                self.kv.cache_computed(req)
                if req.embed and s.sample:
                    self.finish_request(req.request_id, "embedded")
                    changed.append(req)
                continue
            tokens = [sampled[req.request_id]]
            if s.draft:
                tokens = accept(s.draft, [*(verified or {})[req.request_id], tokens[0]])
                self.draft_tokens_total += len(s.draft)
                self.accepted_tokens_total += len(tokens) - 1
            reason = self._append(req, tokens)
            # the KV of the accepted draft tokens is valid: their positions are computed
            req.num_computed_tokens = known + req.num_new_tokens - 1
            self.kv.cache_computed(req)
            if reason is not None:
                self.finish_request(req.request_id, reason)
            changed.append(req)
        return changed

    def _append(self, req: Request, tokens: list[int]) -> str | None:
        """Appends the tokens up to the first that finishes req; why it finishes, if it does."""
        req.num_new_tokens = 0
        for token in tokens:
            req.output_token_ids.append(token)
            req.num_new_tokens += 1
            self.generation_tokens_total += 1
            reason = self._stop_reason(req, token)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        stoppable = len(req.output_token_ids) > params.min_tokens  # this token included
        if stoppable and not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if stoppable and token in params.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        if req.prefill_only:
            return "handoff"
        return None

    def stop_at(self, req: Request, kept: int) -> None:
        """A stop string or a complete grammar ended req at the `kept`-th token its last step
        appended: the accepted draft tokens after it are taken back, and req finishes 'stop'
        (also one that ended on that token or later, on eos, length or for a hand-off)."""
        extra = req.num_new_tokens - kept
        if extra > 0:
            del req.output_token_ids[-extra:]
            req.num_new_tokens = kept
            self.generation_tokens_total -= extra
        if req.is_finished:
            req.finish_reason = "stop"
        else:
            self.finish_request(req.request_id, "stop")

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """Finish a request wherever it is (stop string, abort); frees its blocks, or holds them
        for a 'handoff' (see KVCacheManager.hold). Unknown id: None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if reason == "handoff":
                self.kv.hold(req)
            else:
                self.kv.free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.late:
            self.late.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.forget(req)
        return req


def _prefilling(req: Request) -> bool:
    return req.num_tokens - req.num_computed_tokens > 1


def _new_prompt(req: Request) -> bool:
    """Waits for its first token here: never admitted, no output yet, and no KV handed over
    (a decode worker's request got its first token from the prefill worker)."""
    handed_off = req.importing or req.num_imported_tokens > 0
    return req.first_scheduled_time is None and not req.output_token_ids and not handed_off


def _urgency(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower first."""
    return req.priority, req.arrival_time
