"""Rejection sampling in the flattened batch layout, torch twin (docs/design.md §2-§3).

Request r owns drafts ``draft_token_ids[cu[r]:cu[r+1]]`` (n_r of them, possibly 0) and target rows
``cu[r] + r ... cu[r+1] + r``: its n_r verify rows, then its bonus row. With p_i the processed
target distribution of verify row i and q_i the proposer's distribution:

    full rule      (draft_probs given):  accept d_i  iff  u_i * q_i(d_i) < p_i(d_i)
                                         recovered ~ norm(max(0, p_i - q_i))
    one-hot rule   (no draft_probs):     accept d_i  iff  u_i < p_i(d_i)
                                         recovered ~ norm(p_i with d_i zeroed)
    greedy target  (temperature 0):      accept d_i  iff  d_i == argmax p_i;  emit argmax
    synthetic      (rates given):        accept d_i  iff  u_i < c_i;  emit as the row's own rule

A draft id of -1 means "no draft here": the request's drafts end at its first -1, and the row
of that -1 is sampled as its bonus row would be (p, sample stream). Any other id outside
[0, V) is a ValueError (``check_draft_ids``). A residual that is all zero (p = q up to
rounding) falls back to p. Only the first rejected
position is sampled (O(B V) noise, not O(B k V)); when all drafts pass the bonus token is sampled
from the bonus row. ``u_i`` comes from the acceptance stream at the draft's position, the recovered
token from the residual stream, the bonus from the sample stream (docs/design.md §4), so a request's
tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from types import ModuleType

import torch

from verispec.ops import philox, sampling
from verispec.ops.sampling import (
    FLOAT_DTYPES,
    INT_DTYPES,
    LOGITS_DTYPES,
    _processed_probs,
    check_logits,
    check_params,
    check_tensor,
    first_argmax,
    race,
)

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    max_num_draft_tokens: int,
    synthetic_conditional_rates: torch.Tensor | None = None,
    all_greedy: bool = False,
    *,
    check_draft_ids: bool = True,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Verify the drafts of a batch and return each request's output tokens.

    Parameters
    ----------
    target_logits : [num_draft_tokens + B, V] float32 / bfloat16 / float16
        Request r's rows are its n_r verify rows followed by its bonus row.
    draft_token_ids : [num_draft_tokens] int32 / int64, all requests' drafts concatenated; -1
        ends a request's drafts ("no draft here": its row is sampled as the bonus row).
    cu_num_draft_tokens : [B + 1] int32 / int64, leading 0; request r owns ``[cu[r], cu[r+1])``.
    draft_probs : [num_draft_tokens, V] float32 or None
        q for each draft (full rule); None selects the one-hot rule (greedy or n-gram drafts).
    temperature : [B] float32, 0 = greedy target.
    top_k : [B] int32 (0 or -1 = off) or None (off for all).
    top_p : [B] float32 (1.0 = off) or None.
    min_p : [B] float32 (0.0 = off) or None.
    seeds : [B] int64 request seeds.
    positions : [B] int64, the position the first draft token of each request occupies (its
        committed length); draft i of request r decides position ``positions[r] + i``.
    max_num_draft_tokens : int, static bound on n_r (usually k); sets the output width without a
        host sync.
    synthetic_conditional_rates : [>= max_num_draft_tokens] float32 or None
        Conditional acceptance rates c_i; given, acceptance ignores p and q (benchmarking only).
    all_greedy : the caller's host-side knowledge that every request is greedy (skips the noise).
    check_draft_ids : raise ``ValueError`` for a draft id outside [-1, V). The check reads the
        ids on the host (a sync on a GPU); callers whose drafts are in range by construction
        (the engine's proposers) turn it off. Skipped while a CUDA graph is being captured.
    kernels : the compiled CPU kernels (``Backend.cpu``), or None. Given, CPU tensors take
        p from the ops below and the rest from one compiled call (``_compiled``).

    Returns
    -------
    token_ids : [B, max_num_draft_tokens + 1] int32
        Row r: the accepted drafts, then the recovered or bonus token, then -1 padding. The number
        of output tokens of request r is ``(token_ids[r] != -1).sum()``.
    """
    check_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                 top_k, top_p, min_p, seeds, positions, max_num_draft_tokens,
                 synthetic_conditional_rates)
    device = target_logits.device
    num_draft_tokens = draft_token_ids.shape[0]
    batch_size = cu_num_draft_tokens.shape[0] - 1
    width = max_num_draft_tokens + 1
    if check_draft_ids:
        check_draft_token_ids(draft_token_ids, target_logits.shape[1])
    if kernels is not None and device.type == "cpu" and synthetic_conditional_rates is None:
        return _compiled(kernels, target_logits, draft_token_ids, cu_num_draft_tokens,
                         draft_probs, temperature, top_k, top_p, min_p, seeds, positions, width,
                         all_greedy)

    cu = cu_num_draft_tokens.to(torch.int64)
    num_drafts = cu[1:] - cu[:-1]  # [B]
    req_ids = torch.arange(batch_size, device=device)
    draft_ids = draft_token_ids.to(torch.int64)
    # Request and in-request index of each draft token; output_size avoids a host sync.
    draft_req = torch.repeat_interleave(req_ids, num_drafts, output_size=num_draft_tokens)
    draft_index = torch.arange(num_draft_tokens, device=device) - cu[draft_req]
    # a request's drafts end at its first -1 ("no draft here"): n_r counts those before it
    present = torch.ones(batch_size, width, dtype=torch.int64, device=device)
    present[draft_req, draft_index] = (draft_ids >= 0).to(torch.int64)
    num_present = torch.minimum(torch.cumprod(present, dim=1).sum(1), num_drafts)  # [B]
    safe_ids = draft_ids.clamp_min(0)  # -1 is never gathered as token V - 1
    verify_rows = torch.arange(num_draft_tokens, device=device) + draft_req  # [N]
    row_req = torch.repeat_interleave(
        req_ids, num_drafts + 1, output_size=num_draft_tokens + batch_size
    )

    greedy = temperature == 0  # [B]
    argmax_rows = first_argmax(target_logits)  # [N + B]
    if all_greedy:
        probs = None
    else:
        probs = _processed_probs(
            target_logits,
            temperature[row_req],
            None if top_k is None else top_k[row_req],
            None if top_p is None else top_p[row_req],
            None if min_p is None else min_p[row_req],
        )  # [N + B, V] float32

    # --- acceptance of every draft (only the leading run of accepts counts) ---
    u = philox.uniform(
        seeds[draft_req], positions[draft_req] + draft_index, philox.ACCEPT_STREAM, 0, kernels
    )  # [N] in (0, 1)
    accepted = draft_ids == argmax_rows[verify_rows]
    if synthetic_conditional_rates is not None:
        accepted = u < synthetic_conditional_rates.to(torch.float32)[draft_index]
    elif probs is not None:
        p_d = probs[verify_rows, safe_ids]
        if draft_probs is not None:
            # u * q(d) < p(d); q(d) = 0 cannot come from a sampled draft: reject it.
            q_d = draft_probs[torch.arange(num_draft_tokens, device=device), safe_ids]
            accept_random = (u * q_d < p_d) & (q_d > 0)
        else:
            accept_random = u < p_d  # p(d) = 0 never passes: u > 0
        accepted = torch.where(greedy[draft_req], accepted, accept_random)
    accepted = accepted & (draft_ids >= 0)

    accepted_pad = torch.zeros(batch_size, width, dtype=torch.int64, device=device)
    accepted_pad[draft_req, draft_index] = accepted.to(torch.int64)
    num_accepted = torch.cumprod(accepted_pad, dim=1).sum(1)  # [B], <= n_r
    rejected = num_accepted < num_present  # [B]; at a -1 row no draft was rejected: bonus

    # --- the one token sampled per request: recovered at the first rejection, else bonus ---
    final_rows = cu[:-1] + req_ids + num_accepted  # verify row of draft num_accepted, or bonus row
    final_ids = argmax_rows[final_rows]
    if probs is not None:
        p = probs[final_rows]  # [B, V]
        weights = p
        if num_draft_tokens > 0:
            first_rejected = (cu[:-1] + num_accepted).clamp_max(num_draft_tokens - 1)
            if draft_probs is not None:
                residual = torch.clamp_min(p - draft_probs[first_rejected], 0.0)
            else:
                residual = p.scatter(1, safe_ids[first_rejected][:, None], 0.0)
            has_residual = residual.sum(-1, keepdim=True) > 0  # else p = q: sample from p
            use_residual = rejected[:, None] & has_residual
            weights = torch.where(use_residual, residual, p)
        stream = torch.where(rejected, philox.RESIDUAL_STREAM, philox.SAMPLE_STREAM)
        random_ids = race(weights, seeds, positions + num_accepted, stream, kernels)
        final_ids = torch.where(greedy, final_ids, random_ids)

    # --- output: accepted drafts, the final token, -1 padding ---
    token_ids = torch.full((batch_size, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                           device=device)
    token_ids[draft_req, draft_index] = draft_ids
    columns = torch.arange(width, device=device)[None, :]
    token_ids = torch.where(columns < num_accepted[:, None], token_ids, PLACEHOLDER_TOKEN_ID)
    token_ids = torch.where(columns == num_accepted[:, None], final_ids[:, None], token_ids)
    return token_ids.to(torch.int32)


def _compiled(kernels: ModuleType, target_logits, draft_token_ids, cu_num_draft_tokens,
              draft_probs, temperature, top_k, top_p, min_p, seeds, positions, width: int,
              all_greedy: bool) -> torch.Tensor:
    """``rejection_sample`` of CPU tensors with the compiled kernels: p and the greedy rows'
    argmax from the torch ops above (the same bits), then the acceptance, the residual, the
    race and the output in one call (``kernels.rejection_rows``) instead of ~45 small torch
    ops, each of which pays its cache misses again after a forward. The same tokens as the ops
    above; the race's logarithm and block sums are C's (``sampling.race``)."""
    batch_size = cu_num_draft_tokens.shape[0] - 1
    num_rows, vocab_size = target_logits.shape
    greedy = all_greedy or bool((temperature == 0).any())  # (a host read is free here)
    argmax_rows = first_argmax(target_logits) if greedy else None
    probs = None
    if not all_greedy:
        cu = cu_num_draft_tokens.to(torch.int64)
        row_req = torch.repeat_interleave(torch.arange(batch_size), cu[1:] - cu[:-1] + 1,
                                          output_size=num_rows)
        probs = _processed_probs(target_logits, temperature[row_req],
                                 *(None if x is None else x[row_req] for x in (top_k, top_p,
                                                                              min_p)))
    token_ids = kernels.rejection_rows(
        probs, draft_probs, argmax_rows, draft_token_ids, cu_num_draft_tokens, vocab_size,
        temperature, all_greedy, seeds, positions,
        (philox.ACCEPT_STREAM, philox.RESIDUAL_STREAM, philox.SAMPLE_STREAM), width,
        sampling.SAMPLING_BLOCK, sampling.BLOCK_NOISE_INDEX)
    if token_ids is None:  # a draft id outside [-1, V): the error the check gives
        check_draft_token_ids(draft_token_ids, vocab_size)
    return token_ids


def check_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, draft_probs, temperature,
                 top_k, top_p, min_p, seeds, positions, max_num_draft_tokens: int, rates=None,
                 contiguous: bool = False) -> None:
    """``ValueError`` naming the first input of a ``rejection_sample`` call outside its contract
    (shapes, dtypes, devices; ``contiguous``: last dimensions contiguous, as kernels read
    them). The draft ids' values are ``check_draft_token_ids``'s."""
    check_logits("target_logits", target_logits, contiguous)
    device = target_logits.device
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, (None,), INT_DTYPES, device,
                 contiguous)
    if cu_num_draft_tokens.shape[0] < 1:
        raise ValueError("cu_num_draft_tokens must be [B + 1] with a leading 0, got [0]")
    check_tensor("draft_token_ids", draft_token_ids, (None,), INT_DTYPES, device, contiguous)
    batch_size = cu_num_draft_tokens.shape[0] - 1
    check_rows(target_logits, draft_token_ids, draft_probs, batch_size, max_num_draft_tokens,
               contiguous)
    check_params(batch_size, device, temperature, top_k, top_p, min_p, seeds, positions,
                 contiguous)
    if rates is not None and (not isinstance(rates, torch.Tensor) or rates.dim() != 1
                              or rates.shape[0] < max_num_draft_tokens or rates.device != device
                              or rates.dtype not in FLOAT_DTYPES
                              or (contiguous and rates.shape[0] > 1 and rates.stride(0) != 1)):
        got = (f"{tuple(rates.shape)} {rates.dtype} on {rates.device}"
               if isinstance(rates, torch.Tensor) else type(rates).__name__)
        raise ValueError(
            f"synthetic_conditional_rates must be 1-D, contiguous, with >= "
            f"{max_num_draft_tokens} floats on {device}, got {got}")


def check_rows(target_logits, draft_token_ids, draft_probs, batch_size: int,
               max_num_draft_tokens: int, contiguous: bool = False) -> None:
    """The row counts of one call agree with each other and with the batch."""
    num_draft_tokens = draft_token_ids.shape[0]
    if num_draft_tokens > batch_size * max_num_draft_tokens:
        raise ValueError(
            f"draft_token_ids has {num_draft_tokens} drafts, more than max_num_draft_tokens = "
            f"{max_num_draft_tokens} for each of {batch_size} requests")
    check_tensor("target_logits", target_logits, (num_draft_tokens + batch_size, None),
                 LOGITS_DTYPES, target_logits.device, contiguous)
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, (num_draft_tokens, target_logits.shape[-1]),
                     (torch.float32,), target_logits.device, contiguous)


def check_draft_token_ids(draft_token_ids: torch.Tensor, vocab_size: int) -> None:
    """``ValueError`` unless every draft id lies in [-1, V) (-1: no draft here). One read of
    the ids' extremes on the host; skipped while a CUDA graph is being captured."""
    if draft_token_ids.numel() == 0:
        return
    if draft_token_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    low, high = torch.stack(torch.aminmax(draft_token_ids)).tolist()
    if low < -1 or high >= vocab_size:
        bad = low if low < -1 else high
        raise ValueError(
            f"draft_token_ids must lie in [0, {vocab_size}) (or be -1: no draft here), got "
            f"{bad}")


def num_output_tokens(token_ids: torch.Tensor) -> torch.Tensor:
    """[B] int64: output tokens per request, the count of non-placeholder entries."""
    return (token_ids != PLACEHOLDER_TOKEN_ID).sum(1)
