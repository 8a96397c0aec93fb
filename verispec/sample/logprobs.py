"""Log probabilities of output tokens under the processed target distribution p (docs/design.md §3).

Every output token is distributed as p of the target row at its position, however it was
produced: sampled in a plain step, accepted as a draft, recovered at the first rejection, or
sampled as the bonus token (that is what exactness means). Its log probability is therefore
``log p(token)`` of that row, never of the residual ``norm(max(0, p - q))`` it may have been drawn
from. In a verify step the row that checks draft i of a request is the row of the position that
draft occupies, the distribution a plain step would have sampled from there; so logprobs are the
same with and without speculation (greedy speculation emits the plain greedy tokens,
docs/design.md §12). The rows come after the request's logits options (penalties, bias, masks:
docs/design.md §15), so those are part of p. Greedy rows (temperature 0) report p computed with
temperature 1 and the request's masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec import ops
from verispec.sample.sampler import SamplingTensors


def token_logprobs(
    logits: torch.Tensor,  # [R, V] target logits, one row per output token
    sampling: SamplingTensors,  # R rows: the parameters of the request each row belongs to
    token_ids: torch.Tensor,  # [R] int64, the output token of each row
    num_top: Sequence[int],  # [R] host ints, how many most likely tokens each row reports
) -> list[dict[int, float]]:
    """The log probability of each row's output token and of its ``num_top`` most likely tokens.

    Returns
    -------
    One dict per row, token id -> log p (float; ``-inf`` for a token the masks removed): the
    ``num_top[r]`` most likely tokens in descending order, then the output token when it is not
    among them (vLLM's per-token logprobs). Copied to the host once, at the end.
    """
    probs = ops.processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                sampling.min_p)  # [R, V] float32
    logp = torch.log(probs)
    chosen = logp.gather(1, token_ids.to(logp.device).long()[:, None])[:, 0]  # [R]
    max_top = min(max(num_top, default=0), logp.shape[1])
    if max_top:
        top_values, top_ids = torch.topk(logp, max_top, dim=-1)  # [R, max_top]
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen, ids = chosen.tolist(), token_ids.tolist()
    entries = []
    for r, (token_id, value) in enumerate(zip(ids, chosen)):
        entry = {}
        if max_top and num_top[r]:
            entry = dict(zip(top_ids[r][: num_top[r]], top_values[r][: num_top[r]]))
        entry.setdefault(token_id, value)
        entries.append(entry)
    return entries


def raw_logprobs(
    logits: torch.Tensor,  # [R, V] target logits
    token_ids: torch.Tensor,  # [R] int64, the token each row scores
    num_top: Sequence[int],  # [R] host ints, how many most likely tokens each row reports
) -> list[dict[int, float]]:
    """``token_logprobs`` under the model's raw distribution ``log_softmax(logits)`` (no sampling
    parameter applies): what ``prompt_logprobs`` reports for each prompt token, as vLLM does.

    Returns
    -------
    One dict per row, as ``token_logprobs``.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V] float32
    chosen = logp.gather(1, token_ids.to(logp.device).long()[:, None])[:, 0].tolist()  # [R]
    max_top = min(max(num_top, default=0), logp.shape[1])
    if max_top:
        top_values, top_ids = torch.topk(logp, max_top, dim=-1)  # [R, max_top]
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    entries = []
    for r, (token_id, value) in enumerate(zip(token_ids.tolist(), chosen)):
        entry = {}
        if max_top and num_top[r]:
            entry = dict(zip(top_ids[r][: num_top[r]], top_values[r][: num_top[r]]))
        entry.setdefault(token_id, value)
        entries.append(entry)
    return entries
