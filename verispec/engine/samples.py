"""Several samples of one prompt (``SamplingParams.n``) and prompt logprobs (docs/design.md §15).

**Samples.** A prompt with ``n`` > 1 becomes n requests, each decoding on its own (its slot,
its seed, its stop conditions), as vLLM's parallel sampling does. Sample j's parameters are the
prompt's with ``n = 1`` and, when a seed is given, ``seed + j`` (vLLM's rule: the samples are
distinct and each is reproducible alone). Only sample 0 computes prompt logprobs (they are the
same for every sample). With the prefix cache on, samples 1..n-1 are held back until sample 0's
prefill is done (``HeldSamples``): its prompt blocks are then published and each sibling's
prefill is a prefix-cache hit over them, so the prompt is computed once and its full blocks are
shared by the n requests; only the last, partial block is each sample's own.

**best_of.** With ``best_of`` > n, best_of samples are generated as above, each computing its
tokens' logprobs (``logprobs`` 0 when the request asked for none: the cumulative logprob needs
them), and the n with the highest cumulative logprob are returned, best first (``best_of``),
their logprobs dropped where the request asked for none.

**Prompt logprobs.** Computed during the prefill: a prefill chunk of tokens ``[c, c + m)``
gives the logits of every position, and position t scores prompt token t + 1 under the raw
distribution ``log_softmax(logits)`` (vLLM's ``prompt_logprobs``). A chunked prefill fills them
chunk by chunk; a recomputed (preempted) request keeps those it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from verispec import ops
from verispec.sample.logprobs import raw_logprobs
from verispec.sampling_params import SamplingParams


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each of the ``params.num_samples`` samples (sample 0 first)."""
    if params.num_samples == 1:
        return [dataclasses.replace(params, best_of=None)]
    # ranking by cumulative logprob needs every sample's logprobs
    logprobs = 0 if params.logprobs is None and params.num_samples > params.n else params.logprobs
    result = []
    for j in range(params.num_samples):
        seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
        result.append(dataclasses.replace(
            params, n=1, best_of=None, seed=seed, logprobs=logprobs,
            prompt_logprobs=params.prompt_logprobs if j == 0 else None))
    return result


def cumulative_logprob(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]]) -> float:
    """The sum of the tokens' log probabilities (``-inf`` for a token the masks removed)."""
    return float(sum(entry[t] for t, entry in zip(token_ids, logprobs)))


def best_of(cumulative: Sequence[float], n: int) -> list[int]:
    """The indices of the ``n`` highest cumulative logprobs, best first (ties: the earlier
    sample first)."""
    return sorted(range(len(cumulative)), key=lambda j: (-cumulative[j], j))[:n]


class HeldSamples:
    """Samples waiting for the first sample of their prompt to finish its prefill."""

    def __init__(self) -> None:
        self._held: list[tuple[object, object]] = []  # (first sample, a later sample)

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, first, request) -> None:
        self._held.append((first, request))

    def release(self) -> list:
        """The held samples whose first sample has computed its prompt (or ended), in order;
        samples aborted while held are dropped."""
        ready, kept = [], []
        for first, request in self._held:
            if request.finished:
                continue
            if first.finished or (first.slot >= 0 and not first.is_prefilling):
                ready.append(request)
            else:
                kept.append((first, request))
        self._held = kept
        return ready


def fill_prompt_logprobs(prefills: Sequence[tuple[object, int]], logits: torch.Tensor,
                         first_rows: np.ndarray) -> None:
    """Append the prompt logprobs a step's prefill chunks give to the requests that ask.

    ``prefills``: (request, m) before the chunk is counted (its tokens are
    ``[num_computed_tokens, + m)``); ``logits`` [num_rows, V] of every position of the step;
    ``first_rows[i]``: the row of chunk i's first token.
    """
    rows, tokens, owners = [], [], []
    for i, (request, m) in enumerate(prefills):
        if not request.needs_prompt_logprobs:
            continue
        start = request.num_computed_tokens
        # position start + j scores token start + j + 1: the next one still to fill, up to
        # the last prompt token (the chunk's last row of the last chunk scores the output)
        first = len(request.prompt_logprobs) - 1 - start
        stop = min(m, request.num_prompt_tokens - 1 - start)
        if first < 0 or first >= stop:
            continue
        rows.append(first_rows[i] + np.arange(first, stop))
        tokens.append(request.token_ids[start + first + 1:start + stop + 1])
        owners.append((request, stop - first))
    if not rows:
        return
    entries = raw_logprobs(
        logits[ops.to_device(np.concatenate(rows), logits.device)],
        ops.to_device(np.concatenate(tokens), logits.device, torch.int64),
        [r.params.prompt_logprobs for r, count in owners for _ in range(count)])
    start = 0
    for request, count in owners:
        request.prompt_logprobs.extend(entries[start:start + count])
        start += count
