"""Per-request sampling settings, named and defaulted as vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of ``json``
    (a JSON schema, as a dict or its text), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings) or ``grammar`` (an EBNF grammar: Lark syntax, or GBNF as
    llama.cpp writes it). Compiled when the request is added (docs/design.md §15); a grammar
    the engine cannot compile is a ValueError naming the field."""

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its "
                             f"text), got {self.json!r:.200}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got "
                                 f"{value!r:.200}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r:.200}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")


LOGIT_BIAS_LIMIT = 100.0
MAX_N = 128  # samples of one prompt per request (vLLM has no limit; this keeps a typo cheap)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    ``temperature`` 0 means greedy (argmax). ``top_k`` 0 or -1 disables top-k, ``top_p`` 1.0 and
    ``min_p`` 0.0 disable theirs. The processed distribution is logits / temperature, then top-k,
    top-p and min-p masks, renormalised (docs/design.md §3). ``seed`` None draws one at admission.
    ``stop`` strings and ``stop_token_ids`` end the request; the EOS token does too unless
    ``ignore_eos``. ``max_tokens`` counts generated tokens. ``logprobs`` None returns no log
    probabilities; an integer N returns, for every output token, its log probability under the
    processed distribution and those of the N most likely tokens (vLLM's meaning; 0 = the
    token's alone).

    Logits options (vLLM's names and meanings; docs/design.md §15 for how they stay exact under
    speculation), applied in this order to the target's logits before temperature:
    ``allowed_token_ids`` masks every other token; ``bad_words`` (strings, tokenised with and
    without a leading space) masks the last token of a bad word when the output so far ends
    with the tokens before it; ``min_tokens`` masks EOS and ``stop_token_ids`` while the output
    is shorter than it; ``logit_bias`` (token id -> bias, clamped to [-100, 100]) is added;
    then ``repetition_penalty`` (> 0, 1 = off) divides the positive and multiplies the negative
    logits of every token in the prompt or the output, ``frequency_penalty`` (in [-2, 2])
    subtracts the token's count in the output times itself and ``presence_penalty`` (in
    [-2, 2]) itself once for every token the output holds. ``n`` samples of the prompt are
    generated (sample j with ``seed + j`` when a seed is given), each a request of its own that
    reuses the first sample's prompt blocks (``RequestOutput.outputs``). ``best_of`` (None =
    ``n``; at least ``n``) generates that many samples and returns the ``n`` with the highest
    cumulative log probability (the sum of their tokens' log probabilities under the processed
    distribution, ``CompletionOutput.cumulative_logprob``), best first: vLLM's meaning.

    ``prompt_logprobs`` N returns, for every prompt token after the first, its log probability
    given the tokens before it and those of the N most likely tokens there (vLLM's meaning:
    the model's raw distribution, before any sampling parameter; the first token's entry is
    None). Such a request computes its whole prompt (no prefix-cache hit).

    ``structured_outputs`` (a ``StructuredOutputsParams`` or a dict of its fields) masks every
    token that would take the output out of a JSON schema, regex, choice list or grammar.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or math.isnan(self.temperature) or (
            self.temperature < 0 or math.isinf(self.temperature)
        ):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1) or (
                self.top_k >= 2**31):  # sampled as int32; any k >= the vocabulary is off
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 or -1 = off), got "
                             f"{self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens < 2**63:
            raise ValueError(f"max_tokens must be an integer in [1, 2**63), got "
                             f"{self.max_tokens!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
                _is_int(t) and 0 <= t < 2**63 for t in ids):
            raise ValueError(
                "stop_token_ids must be a list of non-negative 64-bit integers, "
                f"got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0 or None, got "
                             f"{self.prompt_logprobs!r}")
        self._check_options()

    def _check_options(self) -> None:
        """The logits options and ``n`` (token ids against the vocabulary are checked where the
        model is known, when the request is added)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{rp!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                    _is_int(t) and 0 <= t < 2**63 and _is_number(b) and math.isfinite(b)
                    for t, b in bias.items()):
                raise ValueError("logit_bias must map token ids (integers >= 0) to finite "
                                 f"numbers, got {bias!r:.200}")
            # clamped as vLLM's server does: beyond +-100 a bias only forces or bans a token
            object.__setattr__(self, "logit_bias", {
                t: float(min(max(b, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT))
                for t, b in bias.items()} or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed or not all(
                    _is_int(t) and 0 <= t < 2**63 for t in allowed):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids "
                                 f"(integers >= 0), got {allowed!r:.200}")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        words = self.bad_words
        if words is not None:
            if isinstance(words, str):
                words = (words,)
            if not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got "
                                 f"{self.bad_words!r:.200}")
            object.__setattr__(self, "bad_words", tuple(words) or None)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
            object.__setattr__(self, "structured_outputs", so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {so!r:.200}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of)
                                         or not self.n <= self.best_of <= MAX_N):
            raise ValueError(f"best_of must be None or an integer in [n, {MAX_N}] (n={self.n}),"
                             f" got {self.best_of!r}")

    @property
    def num_samples(self) -> int:
        """Samples generated for the prompt: ``best_of``, or ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether any penalty reads the request's token counts."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def uses_logits_options(self) -> bool:
        """Whether any option changes the target's logits (penalties, bias, masks)."""
        return (self.uses_penalties or self.logit_bias is not None or self.min_tokens > 0
                or self.allowed_token_ids is not None or self.bad_words is not None
                or self.structured_outputs is not None)
