"""Async scheduling (``async_scheduling``): plain decoding steps queued one ahead of the host.

In order, a step's host work (commit the sampled tokens, schedule the next step, build its
inputs) runs while the GPU waits: ~17 % of a busy engine's time (docs/benchmarks.md). Here step
N + 1 is scheduled and queued before the host reads step N's tokens: each decode's input is its
last token, and where that is step N's token (still on the device) the forward copies it there
(``ModelRunner.forward``'s ``first_tokens``). The host then waits for step N's tokens alone, and
commits them while the GPU runs step N + 1.

The bookkeeping, per engine call: (1) the requests of step N take a placeholder token, so their
lengths, positions and KV reservations are those of the committed token; (2) schedule and queue
step N + 1 (its tokens' copy to the host starts behind it); (3) read step N's tokens and commit
them in place of the placeholders, with the usual stop checks. Between calls no placeholder is
left: a request's output holds its committed tokens, one step behind the device.

Why a request's tokens do not change: step N + 1 feeds the same token at the same position
with the same seed as in order; its batch may differ (a request that step N ends is in it, its
row thrown away, and requests are admitted a step apart), which the batch-invariant kernels make
irrelevant (docs/design.md §12). A request whose placeholder reaches ``max_tokens`` or the model
length ends at step N whatever its token: it gives its slot and blocks back before step N + 1
is scheduled, as it would in order. The KV cache of a
request is one token ahead between calls (the queued step wrote its last token); a request
ended at step N had its last token written by step N + 1, into blocks it just freed, before any
later step (queued after) can reuse them.

Steps run in order (the pending step committed first) while a request needs the host in between:
logprobs, prompt logprobs, logits options (penalties, grammars, bad words, min_tokens, bias,
allowed ids) or several samples; or while the KV pool has fewer free blocks than requests
decode, where the scheduler might preempt a request whose last token is not on the host yet.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from verispec import ops
from verispec.engine.request import Request

PLACEHOLDER = -1  # a token sampled by a step still queued (never fed: see first_tokens)


@dataclasses.dataclass
class PendingStep:
    """A queued step's sampled tokens: ``tokens`` [B] on the device, row i of ``requests[i]``,
    copied into ``host`` (pinned on CUDA) behind the step; ``placeholders`` once they stand in
    the requests' token lists."""

    requests: list[Request]
    tokens: torch.Tensor  # [B] int64
    host: torch.Tensor  # [B] int64
    copied: torch.cuda.Event | None
    row_of: dict[int, int]  # request id -> row
    placeholders: bool = False

    @classmethod
    def start(cls, requests: list[Request], tokens: torch.Tensor,
              buffer: torch.Tensor | None = None) -> PendingStep:
        """The step's tokens on their way to the host: on CUDA into ``buffer`` (pinned, at
        least [B] int64), an event after the copy."""
        copied = None
        host = tokens
        if tokens.device.type == "cuda":
            host = buffer[:tokens.shape[0]]
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return cls(requests, tokens, host, copied,
                   {r.request_id: i for i, r in enumerate(requests)})

    def read(self) -> list[int]:
        """The tokens on the host (waits for the step, not for what was queued after it)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def sampled_rows(decodes: list[Request], prefills: list[tuple[Request, int]]
                 ) -> tuple[list[int], list[Request]]:
    """After a forward over ``decodes`` (a row each) and ``prefills`` (their last rows): count
    the chunks computed; the rows that sample a token and their requests (every decode, and
    each request whose prefill this chunk completes: a recomputed one samples at its next
    step, which feeds its last token)."""
    for r, n in prefills:
        r.num_computed_tokens += n
    rows = list(range(len(decodes)))
    batch = list(decodes)
    for i, (r, _) in enumerate(prefills):
        if not r.is_prefilling and not r.num_output_tokens:
            rows.append(len(decodes) + i)
            batch.append(r)
    return rows, batch


class OverlappedSteps:
    """The steps of ``async_scheduling`` (mixed into ``StepLoop``, whose state they use)."""

    async_scheduling: bool
    _pending: PendingStep | None
    _host_buffers: list[torch.Tensor] | None  # pinned, for the queued steps' tokens

    def _overlap_ok(self) -> bool:
        """Whether the next step may be queued before the pending one is committed."""
        if not self.async_scheduling or self.spec is not None:
            return False
        scheduler = self.scheduler
        if scheduler.in_order_ids:  # a request whose steps need its previous token on the host
            return False
        cache = scheduler.kv_cache
        return cache is None or cache.pool.num_free >= len(scheduler.running)

    def _in_order_first(self) -> list[Request] | None:
        """Before a step in order: commit the pending step (the requests it ends), or None when
        there is none."""
        pending, self._pending = self._pending, None
        return None if pending is None else self._commit_pending(pending)

    def _overlapped_step(self) -> list[Request]:
        """Schedule and queue a step, then commit the pending one (see the module docstring)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            for r in pending.requests:
                if not r.finished:
                    r.append(PLACEHOLDER)
                    # It ends at the pending step whatever its token: no step after it, and
                    # its slot and blocks go to this step's requests (whose work the device
                    # runs after the pending step's; its full blocks hold committed tokens).
                    r.ending = (r.num_output_tokens >= r.params.max_tokens
                                or r.num_tokens >= self.max_model_len)
                    if r.ending:
                        self.scheduler.finish(r)
            pending.placeholders = True
        plan = self.scheduler.schedule()
        self.num_steps += 1
        if plan.decodes or plan.prefills:
            self._pending = self._queue_step(plan.decodes, plan.prefills, pending)
        finished = [] if pending is None else self._commit_pending(pending)
        self.scheduler.publish([r for r in plan.requests if not r.finished])
        return finished

    def _queue_step(self, decodes: list[Request], prefills: list[tuple[Request, int]],
                    pending: PendingStep | None) -> PendingStep | None:
        """One forward over the decodes' last tokens and the prefill chunks, and the sampling
        of each decode and each prefill it completes, queued; None when nothing is sampled."""
        token_ids = [[r.last_token_id] for r in decodes] + [
            r.token_ids[r.num_computed_tokens:r.num_computed_tokens + n].tolist()
            for r, n in prefills]
        first_tokens = None
        if pending is not None:
            rows = [b for b, r in enumerate(decodes) if r.request_id in pending.row_of]
            index = [pending.row_of[decodes[b].request_id] for b in rows]
            if rows:
                first_tokens = (np.asarray(rows, dtype=np.int64),
                                pending.tokens[ops.to_device(index, pending.tokens.device)])
        logits = self.runner.forward([r.slot for r in decodes] + [r.slot for r, _ in prefills],
                                     token_ids, logits="last", first_tokens=first_tokens)
        rows, batch = sampled_rows(decodes, prefills)
        if not batch:
            return None
        if len(rows) < logits.shape[0]:
            logits = logits[ops.to_device(rows, logits.device)]
        logits = self.options.process(logits, batch)
        # The sampled token of request r occupies position num_tokens (prompt included).
        positions = ops.to_device([r.num_tokens for r in batch], self.device)
        tokens = self.sampler(logits, self._sampling_tensors(batch), positions)
        return PendingStep.start(batch, tokens, self._host_buffer(tokens))

    def _host_buffer(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """A pinned [max_num_seqs] int64 buffer for a queued step's tokens on CUDA: two in turn
        (a step's tokens are read before the step after the next one is queued)."""
        if tokens.device.type != "cuda":
            return None
        buffers = self._host_buffers
        if buffers is None:
            buffers = self._host_buffers = [
                torch.empty(self.max_num_seqs, dtype=torch.int64, pin_memory=True)
                for _ in range(2)]
        buffers.reverse()
        return buffers[0]

    def _commit_pending(self, pending: PendingStep) -> list[Request]:
        """Commit a queued step's tokens (in place of their placeholders); the requests that
        finished. A request aborted since is left as it is."""
        finished = []
        for r, token in zip(pending.requests, pending.read()):
            if r.finished:
                continue
            if pending.placeholders:
                r.num_tokens -= 1  # the placeholder gives way to the token
            released, r.ending = r.ending, False
            if self._commit(r, [token], truncate=False, release=not released):
                finished.append(r)
        return finished
