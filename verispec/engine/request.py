"""A request's life in the engine, and what ``LLM.generate`` returns for it.

Per-request errors: a request whose input is invalid (empty prompt, text that is not valid
Unicode, prompt + ``max_tokens`` beyond ``max_model_len``, a token id outside the vocabulary,
...) never enters the engine. Its
``RequestOutput`` has ``finish_reason="error"`` and ``error`` holding the message of the
ValueError naming the cause; the other requests of the batch run normally. (``LLM.generate`` on a
single prompt, not a list, raises that ValueError instead.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from verispec.engine.metrics import SpecDecodingStats
from verispec.sample.options import RequestOptions
from verispec.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "error")


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter``) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first, over the time after the first token."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        span = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / span if span > 0 else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``): sample ``index`` of the ``n``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    # The sum of its tokens' log probabilities, when they were computed (logprobs, best_of).
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request, in the order of the prompts given to ``generate``.

    ``token_ids`` are the generated tokens; one that ended the request (EOS or a stop token id)
    is included, and left out of ``text``. A stop string ends ``text`` just before it (its
    tokens stay in ``token_ids``). ``finish_reason`` is ``"stop"`` (EOS, stop token, stop
    string), ``"length"`` (``max_tokens`` reached), ``"abort"`` (``LLM.abort_request``) or
    ``"error"`` (the request was invalid: ``error`` says why; text and token_ids are empty).

    ``outputs`` holds the samples of the prompt as vLLM's ``RequestOutput.outputs`` does: one
    ``CompletionOutput`` per sample (``SamplingParams.n``), in order; ``text``, ``token_ids``,
    ``finish_reason``, ``logprobs`` and the counters are those of sample 0 (so code written for
    n = 1 reads them directly), and ``finish_reason`` is set once every sample has finished.
    With ``best_of`` > n, once every sample has finished ``outputs`` holds the n best of them,
    best first, and ``text``, ``token_ids`` and ``logprobs`` are the best one's (before that,
    samples 0..n-1 as they stand).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    # Speculative decoding counters of this request (None without speculation).
    spec_stats: SpecDecodingStats | None = None
    # With SamplingParams.logprobs set: one dict per token of token_ids, token id -> log
    # probability under the processed target distribution (verispec.sample.logprobs).
    logprobs: list[dict[int, float]] | None = None
    # Prompt tokens whose KV came from the prefix cache instead of being computed (vLLM's
    # ``num_cached_tokens``; the server's ``usage.prompt_tokens_details.cached_tokens``).
    num_cached_tokens: int = 0
    # Every sample of the prompt (one when n = 1; empty for an invalid request).
    outputs: list[CompletionOutput] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs set: None for the first prompt token, then one dict per
    # prompt token (token id -> raw log probability given the tokens before it).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """One request's state. Satisfies ``verispec.proposers.base.ProposalRequest``."""

    def __init__(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        max_model_len: int,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.temperature = params.temperature
        self.slot = -1  # assigned at admission
        self.num_prompt_tokens = len(prompt_token_ids)
        # Committed tokens (prompt, then output) in one preallocated buffer, as long as the
        # request can ever get (not max_model_len: a long-context server queues many requests).
        capacity = min(max_model_len, self.num_prompt_tokens + params.max_tokens)
        self._token_buf = np.zeros(max(capacity, self.num_prompt_tokens), dtype=np.int64)
        self._token_buf[: self.num_prompt_tokens] = prompt_token_ids
        self.num_tokens = self.num_prompt_tokens
        self.max_num_draft_tokens = 0  # set by a speculative engine step
        # Its logits options as token ids (None: it uses none), set when it is added.
        self.options: RequestOptions | None = None
        self.spec_stats: SpecDecodingStats | None = None  # set at admission when speculating
        self.admission = 0  # order of its latest admission (the newest is preempted first)
        # Tokens whose KV the cache holds for this request (the prefix-cache hit, then the
        # prefill chunks run so far); the prefill is done when it reaches num_tokens - 1
        # (a fresh request: num_tokens) and the request decodes.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens of the first admission's prefix-cache hit
        self.prefill_end = 0  # num_computed_tokens at which its prefill ends (set at admission)
        self.block_keys: list[bytes] = []  # prefix-cache keys of its full blocks, in order
        # The speculative planner's state of a preempted request, restored when it is
        # recomputed (engine.spec_decode).
        self.spec_plan_state: tuple | None = None
        self.finish_reason: str | None = None
        # It ends at a step still queued whatever that step's token (engine.overlap): the
        # scheduler gives it no further step.
        self.ending = False
        self.stop_text_len: int | None = None  # text cut before a stop string
        # One dict per output token when the request asked for logprobs (RequestOutput.logprobs)
        self.logprobs: list[dict[int, float]] | None = None if params.logprobs is None else []
        # [None, then one dict per prompt token] when it asked for prompt logprobs (filled
        # during its prefill, docs/design.md §15)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            None if params.prompt_logprobs is None else [None])
        # The samples of its prompt when SamplingParams.n > 1 (itself first), else None.
        self.samples: list[Request] | None = None
        # With best_of > n (on sample 0): (n, whether the request asked for logprobs).
        self.best_of: tuple[int, bool] | None = None
        self.metrics = RequestMetrics(time.perf_counter() if arrival_time is None
                                      else arrival_time)

    @property
    def token_ids(self) -> np.ndarray:
        """[num_tokens] int64 view: the committed tokens."""
        return self._token_buf[: self.num_tokens]

    @property
    def grammar(self):
        """Its structured output's matcher (``GrammarMatcher``), or None: what a proposer drafts
        under (the engine syncs it to the committed output before each propose)."""
        return None if self.options is None else self.options.grammar

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._token_buf[: self.num_prompt_tokens].tolist()

    @property
    def output_token_ids(self) -> np.ndarray:
        return self._token_buf[self.num_prompt_tokens : self.num_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return int(self._token_buf[self.num_tokens - 1])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_prefilling(self) -> bool:
        """Admitted, and its prefill has chunks left to run."""
        return self.num_computed_tokens < self.prefill_end

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are still to compute (its prefill computes
        every prompt token then: no prefix-cache hit)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def append(self, token_id: int) -> None:
        self._token_buf[self.num_tokens] = token_id
        self.num_tokens += 1
