"""Continuous batching over the paged KV cache: requests wait for a slot and for KV blocks, run
together, give their blocks back under memory pressure, and leave when done (docs/design.md §13).

A step (``StepPlan``) holds the *decodes* (running requests past their prefill: one token, or a
verify of k + 1 with speculation) and the *prefill chunks* (requests computing their prompt).

- **Token budget.** ``max_num_batched_tokens`` per step. With chunked prefill (the default)
  running requests come first: every decode (counted at its ``lookahead`` tokens), then the
  next chunk of each request whose prefill is under way, oldest first, then newly admitted
  requests, each taking what is left of the budget; a long prompt is split over as many steps
  as it needs while the others keep decoding. Without it (``chunked_prefill=False``) a step is
  either a prefill of whole prompts (within the budget; a longer single prompt runs alone) or
  a decode step of every running request, prefill first.
- **Attention budget** (``prefill_attention_budget``, off by default). A chunk's cost grows with
  its context: n new tokens after s computed ones attend ``n * s + n (n + 1) / 2`` (query, key)
  pairs, so at a long context even a short chunk makes a step that the decoding requests wait
  on. With the budget, while a step has decodes its prefill chunks together attend at most that
  many pairs (the first chunk at least one token, so the prompt advances); a step without
  decodes (nobody waits) takes the token budget alone.
- **Admission** takes waiting requests in order while a slot is free, budget is left and the
  pool has the blocks. With a prefix cache the request first takes the longest run of
  published blocks that hold its first tokens (``runtime.prefix_cache``): its prefill starts
  after them (not a request that asks for prompt logprobs: it computes its whole prompt).
- **Reservation**: before a step every running request holds blocks for what the step writes:
  a decode its committed tokens plus ``lookahead`` (k + 1 with speculation: the verify rows, and
  a proposer's drafting rows, which share the target's block tables), a prefill chunk its
  tokens.
- **Preemption** (recompute, as vLLM's default): when a running request cannot get a block, the
  most recently admitted running request publishes its full blocks, gives all its blocks back
  and returns to the front of the queue; it is prefilled again later over its prompt and the
  tokens it already has (its published blocks make that a prefix-cache hit while they last).
  Its tokens do not change: every draw is keyed by (seed, position), and prefill, decode and
  verify compute a position's logits the same way (batch invariance). Nothing is lost or failed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from verispec.engine.request import Request
from verispec.runtime.kv_cache import KVCache
from verispec.runtime.prefix_cache import PrefixCache


def attention_pairs(start: int, n: int) -> int:
    """(query, key) pairs of n new tokens after ``start`` computed ones, causal."""
    return n * start + n * (n + 1) // 2


def needs_host_between_steps(request: Request) -> bool:
    """Whether a step of ``request`` needs its previous token on the host (it runs in order)."""
    return (request.options is not None or request.logprobs is not None
            or request.prompt_logprobs is not None or request.samples is not None)


@dataclass
class StepPlan:
    """One step: the running requests that decode (or verify), and the prefill chunks:
    ``(request, n)`` computes the request's tokens ``[num_computed_tokens, + n)``."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return self.decodes + [r for r, _ in self.prefills]


class Scheduler:
    def __init__(self, max_num_seqs: int, kv_cache: KVCache | None = None,
                 max_num_batched_tokens: int | None = None, lookahead: int = 1,
                 on_preempt: Callable[[Request], None] | None = None,
                 chunked_prefill: bool = False, prefix_cache: PrefixCache | None = None,
                 prefill_attention_budget: int | None = None) -> None:
        """``kv_cache``: the target's cache whose blocks are planned (None: slots only, every
        request's blocks are reserved as it appends); ``on_preempt(request)`` frees what the
        engine holds for a request being preempted (its caches, the proposer's state);
        ``prefix_cache``: reuse published blocks (None: every prompt is computed);
        ``prefill_attention_budget``: see the module docstring (chunked prefill only)."""
        self.max_num_seqs = max_num_seqs
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.on_preempt = on_preempt
        self.chunked_prefill = chunked_prefill
        self.prefix_cache = prefix_cache
        self.prefill_attention_budget = prefill_attention_budget
        self._attention_left: float = float("inf")  # of the step being planned
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # id() of the requests, waiting or running, whose steps need their previous token on
        # the host (``needs_host_between_steps``): none, and steps may be queued ahead
        # (engine.overlap)
        self.in_order_ids: set[int] = set()
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # a stack: lowest on top
        self.num_preemptions = 0
        self._admissions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if needs_host_between_steps(request):
            self.in_order_ids.add(id(request))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        """Request slots no request holds."""
        return len(self._free_slots)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks in use (0 without a planned cache)."""
        return 0.0 if self.kv_cache is None else self.kv_cache.pool.usage

    def _reserve(self, request: Request, end: int) -> bool:
        """Blocks for the request's positions ``[0, end)``."""
        if self.kv_cache is None:
            return True
        return self.kv_cache.block_tables.reserve(request.slot,
                                                  min(end, self.kv_cache.max_model_len))

    def _decode_end(self, request: Request) -> int:
        return request.num_tokens + self.lookahead

    def _reserve_decodes(self, decodes: list[Request]) -> bool:
        """Blocks for every decode's next step in one pass (the common case), or False with
        nothing taken when the pool lacks them."""
        if not decodes or self.kv_cache is None:
            return True
        cache = self.kv_cache
        slots = np.fromiter((r.slot for r in decodes), dtype=np.int64, count=len(decodes))
        ends = np.fromiter((r.num_tokens for r in decodes), dtype=np.int64, count=len(decodes))
        np.minimum(ends + self.lookahead, cache.max_model_len, out=ends)
        return cache.block_tables.reserve_many(slots, ends)

    def schedule(self) -> StepPlan:
        """The next step. Its lists are new: the step releases finished requests from
        ``running`` while it walks them."""
        budget = self.max_num_batched_tokens
        budget = float("inf") if budget is None else budget
        if not self.chunked_prefill:
            prefills = self._admit(budget)
            if prefills:
                return StepPlan([], prefills)
            budget = 0  # a decode step
        self._attention_left = float("inf")
        plan = self._plan_running(budget)
        plan.prefills += self._admit(budget - self._plan_tokens(plan), first=not plan.prefills)
        if not plan.decodes and not plan.prefills and self.waiting and not self.running:
            return self.schedule()  # everything was preempted: admit again
        return plan

    def _plan_tokens(self, plan: StepPlan) -> int:
        return len(plan.decodes) * self.lookahead + sum(n for _, n in plan.prefills)

    def _plan_running(self, budget: float) -> StepPlan:
        """Every decode, then the next chunk of each prefill under way (oldest first, while
        budget is left), with their blocks reserved."""
        # (a request ``ending`` at a step still queued takes no step after it: engine.overlap)
        decodes = [r for r in self.running if not r.is_prefilling and not r.ending]
        if not self._reserve_decodes(decodes):
            self._preempt_for(decodes)
            decodes = [r for r in self.running if not r.is_prefilling and not r.ending]
        plan = StepPlan(decodes, [])
        budget -= len(decodes) * self.lookahead  # decodes always run (they free blocks)
        if decodes and self.prefill_attention_budget is not None:
            self._attention_left = self.prefill_attention_budget
        for request in [r for r in self.running if r.is_prefilling]:
            n = int(min(request.prefill_end - request.num_computed_tokens, budget))
            n = self._attention_chunk(request.num_computed_tokens, n, first=not plan.prefills)
            if n <= 0:
                break
            while not self._reserve(request, request.num_computed_tokens + n):
                if plan.decodes or plan.prefills:
                    return plan  # it waits for blocks the step's requests will free
                victim = self.running[-1]  # nothing else runs: make room (maybe itself)
                self.preempt(victim)
                if victim is request:
                    return plan
            plan.prefills.append((request, n))
            budget -= n
            self._attention_left -= attention_pairs(request.num_computed_tokens, n)
        return plan

    def _attention_chunk(self, start: int, n: int, first: bool) -> int:
        """The most of ``n`` tokens after ``start`` whose attention fits what is left of the
        step's attention budget (at least one for the step's first chunk)."""
        left = self._attention_left
        if n <= 0 or attention_pairs(start, n) <= left:
            return n
        # the largest m with m * start + m (m + 1) / 2 <= left
        b = 2 * start + 1
        m = int((math.sqrt(b * b + 8 * max(left, 0.0)) - b) // 2)
        while m > 0 and attention_pairs(start, m) > left:
            m -= 1
        return max(m, 1 if first else 0)

    def _preempt_for(self, decodes: list[Request]) -> None:
        """Reserve each decode's blocks, oldest first; one that cannot get them preempts the
        newest running requests (maybe itself)."""
        for request in decodes:
            if request not in self.running:
                continue  # preempted for an older one
            while not self._reserve(request, self._decode_end(request)):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break

    def _admit(self, budget: float, first: bool = True) -> list[tuple[Request, int]]:
        """Admit waiting requests in order while a slot, budget and blocks are left; each
        with the chunk of its prefill this step computes (``first``: no chunk is planned yet)."""
        admitted: list[tuple[Request, int]] = []
        tables = None if self.kv_cache is None else self.kv_cache.block_tables
        while self.waiting and self._free_slots and budget > 0:
            request = self.waiting[0]
            # A recomputed request stops before its last token, which its next step feeds.
            prefill_end = request.num_tokens - (1 if request.num_output_tokens else 0)
            hit = []
            if self.prefix_cache is not None and not request.needs_prompt_logprobs:
                hit = self.prefix_cache.lookup(request, prefill_end)
            computed = len(hit) * (tables.block_size if tables is not None else 0)
            n = prefill_end - computed
            if self.chunked_prefill:
                n = int(min(n, budget))
                n = self._attention_chunk(computed, n, first=not admitted and first)
                if n <= 0:
                    break
            elif admitted and n > budget:
                break
            slot = self._free_slots[-1]
            request.slot = slot
            if tables is not None:
                tables.assign(slot, hit)
            if not self._reserve(request, computed + n):
                if tables is not None:
                    tables.release(slot)
                request.slot = -1
                break
            self._free_slots.pop()
            self.waiting.popleft()
            self._admissions += 1
            request.admission = self._admissions
            request.prefill_end = prefill_end
            request.num_computed_tokens = computed
            if self.prefix_cache is not None:
                self.prefix_cache.count(prefill_end, computed)
                if not request.num_output_tokens:
                    request.num_cached_tokens = computed
            if computed:
                self.prefix_cache.start_lengths(slot, computed)
            admitted.append((request, n))
            budget -= n
            self._attention_left -= attention_pairs(computed, n)
        self.running.extend(r for r, _ in admitted)
        return admitted

    def publish(self, requests: list[Request]) -> None:
        """Publish the requests' full committed blocks to the prefix cache (after a step)."""
        if self.prefix_cache is not None:
            self.prefix_cache.publish(requests)

    def preempt(self, request: Request) -> None:
        """Give the request's slot and blocks back (its full blocks published first); it waits
        at the front of the queue."""
        self.publish([request])
        if self.on_preempt is not None:
            self.on_preempt(request)
        self.running.remove(request)
        self._release_slot(request)
        request.slot = -1
        request.num_computed_tokens = request.prefill_end = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release_slot(self, request: Request) -> None:
        if self.kv_cache is not None:
            self.kv_cache.free(request.slot)
        self._free_slots.append(request.slot)
        self._free_slots.sort(reverse=True)

    def finish(self, request: Request) -> None:
        """Publish the request's full blocks and release its slot and blocks (reused by the
        next step; the request keeps its slot number for the step's remaining bookkeeping)."""
        self.publish([request])
        self.running.remove(request)
        self.in_order_ids.discard(id(request))
        self._release_slot(request)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request, waiting or running (its slot is released)."""
        if request in self.waiting:
            self.waiting.remove(request)
            self.in_order_ids.discard(id(request))
        elif request in self.running:
            self.finish(request)
