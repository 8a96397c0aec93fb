"""Requests in: prompts and sampling parameters become validated requests, queued.

``RequestIntake`` holds this part of ``LLM`` (``engine.llm``), which builds the state it reads
(the attributes declared below), as ``engine.stepping.StepLoop`` holds the step: a prompt is
encoded and checked (``engine.inputs``), gets its request ids and seeds (one stream that every
rank of a tensor-parallel engine agrees on), its per-request sampling options, and with ``n`` or
``best_of`` one request per sample (``engine.samples``); a queued request goes to the scheduler
and to the spawned ranks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from verispec.engine import inputs
from verispec.engine.request import Request
from verispec.engine.samples import HeldSamples, sample_params
from verispec.engine.scheduler import Scheduler
from verispec.runtime.workers import WorkerGroup
from verispec.sample.grammar_compiler import LazyCompiler, mask_threads
from verispec.sample.options import RequestOptions
from verispec.sample.sampler import draw_seed
from verispec.sampling_params import SamplingParams


class RequestIntake:
    """Validated requests from prompts and sampling parameters, and their queueing."""

    encoder: inputs.PromptEncoder
    tokenizer: Any
    model_config: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    scheduler: Scheduler
    _workers: WorkerGroup | None
    _held: HeldSamples
    _next_request_id: int
    _seed_rng: random.Random | None
    device: Any  # torch.device
    _grammars: LazyCompiler | None

    def _make_request(self, prompt: Any, params: Any, several: bool = False) -> Request:
        """A validated request; ValueError naming the cause otherwise. With ``n`` > 1 (only
        where ``several``) it is sample 0 and ``request.samples`` lists all n
        (``engine.samples``)."""
        params = inputs.as_sampling_params(params)
        prompt = inputs.unwrap_prompt(prompt)
        if params.num_samples != 1 and not several:
            raise ValueError(f"n={params.n}, best_of={params.best_of}: this call makes one "
                             "request; use generate, or add one request per sample")
        text, ids = self.encoder.encode(prompt)
        self.encoder.check_params(params, len(ids))
        requests = []
        for p in sample_params(params):
            if p.seed is not None:
                seed = p.seed
            else:
                seed = (draw_seed() if self._seed_rng is None
                        else self._seed_rng.getrandbits(64) - 2**63)
            requests.append(self._new_request(self._next_request_id, text, ids, p, seed))
            self._next_request_id += 1
        if len(requests) > 1:
            requests[0].samples = requests
            if params.num_samples > params.n:  # best_of: the n best are returned
                requests[0].best_of = (params.n, params.logprobs is not None)
        return requests[0]

    def _new_request(self, request_id: int, text: str | None, ids: Sequence[int],
                     params: SamplingParams, seed: int) -> Request:
        request = Request(request_id, text, ids, params, seed, self.max_model_len)
        if self._grammars is None or self._grammars.tokenizer is not self.tokenizer:
            self._grammars = LazyCompiler(self.tokenizer, self.model_config.vocab_size,
                                          mask_threads(self.device.type))
        request.options = RequestOptions.build(params, self.model_config.vocab_size,
                                               sorted(self.eos_token_ids), self.tokenizer,
                                               self._grammars)
        return request

    def _queue_samples(self, request: Request) -> None:
        """Queue a request, and its other samples when it has several (held back until it has
        computed the prompt when the prefix cache can share it: ``engine.samples``)."""
        self._queue(request)
        for sample in (request.samples or [request])[1:]:
            if self.scheduler.prefix_cache is not None:
                self._held.hold(request, sample)
            else:
                self._queue(sample)

    def _queue(self, request: Request) -> None:
        """Queue a validated request (and send it to the spawned ranks with the next step)."""
        self.scheduler.add(request)
        if self._workers is not None:
            self._workers.queue(("add", request.request_id, request.prompt,
                                 request.prompt_token_ids, request.params, request.seed))
