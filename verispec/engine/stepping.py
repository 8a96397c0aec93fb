"""The engine's step: schedule, run the model (or propose and verify), sample, commit.

``StepLoop`` holds the step machinery of ``LLM`` (``engine.llm``), which builds the state it
reads (the attributes declared below; ``engine.builder``) and drives it through ``LLM.step``.
A speculative step replaces "run the model, sample" by "propose, verify" and commits several
tokens per request through the same ``_commit`` (stop conditions checked token by token).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verispec import ops
from verispec.engine import inputs
from verispec.engine.overlap import OverlappedSteps, sampled_rows
from verispec.engine.request import CompletionOutput, Request, RequestOutput
from verispec.engine.samples import best_of, cumulative_logprob, fill_prompt_logprobs
from verispec.engine.scheduler import Scheduler
from verispec.engine.spec_decode import SpeculativeDecoder
from verispec.runtime.cuda_graphs import batch_buckets
from verispec.runtime.model_runner import ModelRunner
from verispec.sample.logprobs import token_logprobs
from verispec.sample.options import SamplingOptions
from verispec.sample.sampler import Sampler, SamplingTensors
from verispec.sampling_params import SamplingParams

logger = logging.getLogger("verispec")


class StepLoop(OverlappedSteps):
    """One engine step over the scheduler's plan, and the outputs it commits (steps queued one
    ahead of the host with ``async_scheduling``: ``engine.overlap``)."""

    runner: ModelRunner
    scheduler: Scheduler
    spec: SpeculativeDecoder | None
    sampler: Sampler
    options: SamplingOptions
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    max_num_seqs: int
    device: torch.device
    model_config: Any
    num_steps: int
    _sampling_cache: tuple[tuple[int, ...], SamplingTensors] | None

    def _output(self, request: Request) -> RequestOutput:
        ids = request.output_token_ids.tolist()
        text_ids = ids
        if request.finish_reason == "stop" and request.stop_text_len is None and ids:
            text_ids = ids[:-1]  # the EOS / stop token ends the request but is not text
        text = inputs.decode_output(self.tokenizer, text_ids)
        if request.stop_text_len is not None:
            text = text[: request.stop_text_len]
        elif not request.finished:
            text = inputs.streamable_text(text, request.params.stop)
        request.metrics.num_generated_tokens = len(ids)
        logprobs = None if request.logprobs is None else list(request.logprobs)
        cumulative = None if logprobs is None else cumulative_logprob(ids, logprobs)
        outputs = [CompletionOutput(0, text, ids, request.finish_reason, logprobs, cumulative)]
        finish_reason = request.finish_reason
        if request.samples is not None:
            outputs = [dataclasses.replace(self._output(r).outputs[0], index=j) if j else
                       outputs[0] for j, r in enumerate(request.samples)]
            if not all(o.finished for o in outputs):
                finish_reason = None
            if request.best_of is not None:
                outputs = _best_of(outputs, *request.best_of, finished=finish_reason is not None)
                text, ids, logprobs = outputs[0].text, outputs[0].token_ids, outputs[0].logprobs
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=ids,
            finish_reason=finish_reason,
            metrics=request.metrics,
            spec_stats=request.spec_stats,
            logprobs=logprobs,
            num_cached_tokens=request.num_cached_tokens,
            outputs=outputs,
            prompt_logprobs=(None if request.prompt_logprobs is None
                             else list(request.prompt_logprobs)),
        )

    def _step(self) -> list[Request]:
        if self._overlap_ok():
            return self._overlapped_step()
        finished = self._in_order_first()  # a step queued ahead is committed first
        if finished is not None:
            return finished
        plan = self.scheduler.schedule()
        self.num_steps += 1
        finished: list[Request] = []
        decodes = plan.decodes
        if self.spec is not None and decodes:  # propose, verify, accept
            outputs = self.spec.step(decodes, self._sampling_tensors(decodes))
            finished += self._commit_all(decodes, outputs, *self.spec.step_logits)
            self.spec.on_committed(decodes)
            decodes = []
        if decodes or plan.prefills:
            finished += self._forward_step(decodes, plan.prefills)
        self.scheduler.publish([r for r in plan.requests if not r.finished])
        return finished

    def _forward_step(self, decodes: list[Request],
                      prefills: list[tuple[Request, int]]) -> list[Request]:
        """One forward over the decodes' last tokens and the prefill chunks; samples the next
        token of each decode and of each request whose prefill this chunk completes (a
        recomputed request's next token comes from its next step: it stops before its last
        token, which that step feeds, so its cache and that step are those it had)."""
        chunks = [r.token_ids[r.num_computed_tokens:r.num_computed_tokens + n].tolist()
                  for r, n in prefills]
        # a chunk of a request asking for prompt logprobs needs the logits of every position
        every = any(r.needs_prompt_logprobs for r, _ in prefills)
        # a step of decodes alone may replay a captured forward, which applies their penalties
        penalties = None if prefills else self.options.step_penalties(decodes)
        logits = self.runner.forward([r.slot for r in decodes] + [r.slot for r, _ in prefills],
                                     [[r.last_token_id] for r in decodes] + chunks,
                                     logits="all" if every else "last", penalties=penalties)
        if every:
            ends = len(decodes) + np.cumsum([n for _, n in prefills])  # [P] row after chunk i
            fill_prompt_logprobs(prefills, logits, ends - [n for _, n in prefills])
            last = np.concatenate([np.arange(len(decodes)), ends - 1])
            logits = logits[ops.to_device(last, logits.device)]
        rows, batch = sampled_rows(decodes, prefills)
        finished = []
        if batch:
            if len(rows) < logits.shape[0]:
                logits = logits[ops.to_device(rows, logits.device)]
            logits = self.options.process(logits, batch, penalties=penalties)
            outputs = [[t] for t in self._sample(batch, logits)]
            finished = self._commit_all(batch, outputs, logits, np.arange(len(batch)))
        if self.spec is not None:
            self.spec.on_prefilled([r for r, _ in prefills])
        return finished

    def _commit_all(self, batch: list[Request], outputs: list[list[int]], logits: torch.Tensor,
                    first_rows: np.ndarray) -> list[Request]:
        """Commit each request's output tokens (and their logprobs); the finished ones."""
        logprobs = self._logprobs(batch, outputs, logits, first_rows)
        return [r for r, tokens, lp in zip(batch, outputs, logprobs)
                if self._commit(r, tokens, lp)]

    def _sampling_tensors(self, batch: list[Request]) -> SamplingTensors:
        key = tuple(r.request_id for r in batch)
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            tensors = SamplingTensors.from_params(
                [r.params for r in batch], [r.seed for r in batch], self.device
            )
            self._sampling_cache = (key, tensors)
        return self._sampling_cache[1]

    def _warm_up_samplers(self) -> None:
        """On CUDA, run the sampler (and the rejection sampler, with speculation) once on dummy
        batches of every graph bucket size, greedy and random, so that their kernels are
        compiled and their launch plans made before the first request: a kernel variant first
        met mid-generation (a batch that shrank past a threshold of the launch plan) would stall
        a step for its compilation. Top-k / top-p / min-p variants still compile on
        first use."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        vocab_size = self.model_config.vocab_size
        sizes = batch_buckets(self.max_num_seqs)  # the graph buckets (also when eager)
        for size in sizes:
            positions = ops.to_device([1] * size, self.device)
            logits = torch.zeros((size, vocab_size), dtype=torch.float32, device=self.device)
            for temperature in (0.0, 1.0):
                sampling = SamplingTensors.from_params(
                    [SamplingParams(temperature=temperature)] * size, [0] * size, self.device)
                self.sampler(logits, sampling, positions)
                if self.spec is not None:
                    self.spec.warm_up(sampling, positions)
        torch.cuda.synchronize(self.device)
        logger.info("samplers warmed up for batch sizes %s in %.1f s", sizes,
                    time.perf_counter() - start)

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> list[int]:
        # The sampled token of request r occupies position num_tokens (prompt included).
        positions = ops.to_device([r.num_tokens for r in batch], self.device)
        token_ids = self.sampler(logits, self._sampling_tensors(batch), positions)
        return token_ids.tolist()  # the step's one host sync

    def _logprobs(self, batch: list[Request], outputs: list[list[int]], logits: torch.Tensor,
                  first_rows: np.ndarray) -> list[list[dict[int, float]] | None]:
        """Per request of the step, the logprobs of its output tokens (None unless it asked):
        output token j of request r came from ``logits[first_rows[r] + j]``."""
        wanted = [i for i, r in enumerate(batch) if r.params.logprobs is not None]
        result: list[list[dict[int, float]] | None] = [None] * len(batch)
        if not wanted:
            return result
        rows = np.concatenate([first_rows[i] + np.arange(len(outputs[i])) for i in wanted])
        owners = np.concatenate([np.full(len(outputs[i]), i) for i in wanted])
        entries = token_logprobs(
            logits[ops.to_device(rows, logits.device)],
            self._sampling_tensors(batch).select(ops.to_device(owners, self.device)),
            ops.to_device([t for i in wanted for t in outputs[i]], logits.device, torch.int64),
            [batch[i].params.logprobs for i in owners],
        )
        start = 0
        for i in wanted:
            result[i] = entries[start : start + len(outputs[i])]
            start += len(outputs[i])
        return result

    def _commit(self, request: Request, token_ids: Sequence[int],
                logprobs: Sequence[dict[int, float]] | None = None, truncate: bool = True,
                release: bool = True) -> bool:
        """Append output tokens in order, stopping at the first that ends the request (no token
        after it is kept), and the logprobs of the tokens kept. Returns True if the request
        finished (its slot is then released, unless ``release`` is False: released already).
        ``truncate``: roll the KV cache back to the committed tokens but the last (a step
        queued ahead has written that one: False)."""
        now = time.perf_counter()
        num_before = request.num_output_tokens
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        params = request.params
        for token_id in token_ids:
            request.append(token_id)
            if token_id in params.stop_token_ids or (
                not params.ignore_eos and token_id in self.eos_token_ids
            ):
                request.finish_reason = "stop"
            elif params.stop and self._hit_stop_string(request):
                request.finish_reason = "stop"
            elif (request.num_output_tokens >= params.max_tokens
                  or request.num_tokens >= self.max_model_len):
                request.finish_reason = "length"
            if request.finished:
                break
        if logprobs is not None:
            request.logprobs.extend(logprobs[: request.num_output_tokens - num_before])
        # The cache holds every committed token but the last, which the next step feeds.
        if truncate:
            self.runner.kv_cache.truncate(request.slot, request.num_tokens - 1)
        if request.finished:
            request.metrics.finished_time = now
            request.metrics.num_generated_tokens = request.num_output_tokens
            if release:
                self.scheduler.finish(request)  # the proposer's state goes in on_committed
        return request.finished

    def _hit_stop_string(self, request: Request) -> bool:
        text = inputs.decode_output(self.tokenizer, request.output_token_ids.tolist())
        index = inputs.find_stop_string(text, request.params.stop)
        if index is not None:
            request.stop_text_len = index
        return index is not None


def _best_of(outputs: list[CompletionOutput], n: int, wants_logprobs: bool,
             finished: bool) -> list[CompletionOutput]:
    """``best_of`` (``engine.samples``): the n best samples by cumulative logprob once all have
    finished (else the first n as they stand), renumbered, logprobs kept only if asked for."""
    chosen = best_of([o.cumulative_logprob for o in outputs], n) if finished else range(n)
    return [dataclasses.replace(outputs[j], index=i,
                                logprobs=outputs[j].logprobs if wants_logprobs else None)
            for i, j in enumerate(chosen)]
