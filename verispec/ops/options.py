"""Sampling options on the target's logits: masks, bias and penalties (docs/design.md §15).

One op, ``apply_options``, turns the logits rows of a step into the logits the request's
sampling parameters ask for, before temperature and the top-k / top-p / min-p masks of
docs/design.md §3. Every row is processed as one-token-at-a-time decoding would process it:
the row that verifies draft d_{i+1} sees the committed tokens plus d_1..d_i (a token tree's
row of node u: the drafts on the path from the root to u, docs/design.md §16). The host builds
the per-row inputs (``OptionTensors``, ``verispec.sample.options``); the drafts themselves stay
on the device and are read through index tensors, so the op needs no host sync. In order
(vLLM's):

    structured output   z_v = -inf for every v the row's grammar mask does not allow
    allowed_token_ids   z_v = -inf for every v outside the row's allowed set
    bad_words           z_t = -inf where the row's context ends with the bad word's prefix
    min_tokens, bias    z_v += b_v  (b = -inf for EOS / stop tokens while the output, drafts
                                     before the row included, is shorter than min_tokens)
    penalties           c_v = count of v in the output and the drafts before the row
                        seen_v = v in the prompt or c_v > 0
                        z_v = z_v / rep if z_v > 0 else z_v * rep      (seen_v only)
                        z_v -= freq * c_v + pres * [c_v > 0]

It is written in torch ops only: on the CPU it is the path itself, on a GPU the same ops run on
the device between the verify forward and the rejection sampler. Each piece is skipped when no
row of the step uses it.

``apply_penalties`` is the penalties alone, in the padded layout of a captured step (B requests
of S rows each, the step's own input ids as the drafts), with the same float operations as
``apply_options``'s: the captured decode and verify forwards run it (``runtime.model_runner``),
so a step of penalised requests needs no eager pass over their rows. A row whose request also
has a finite ``logit_bias`` is left to ``apply_options`` (the bias comes before the penalties
and does not commute with them); the masks (-inf) do commute, so they may follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")
WILDCARD = -2  # a bad word's prefix position that matches anything (shorter prefixes)


@dataclass(frozen=True)
class OptionTensors:
    """Per-row inputs of ``apply_options`` for R rows over a vocabulary of V, on one device.

    ``token_source`` holds every token a row's context may need: the tails of the committed
    outputs, the step's drafts, then one -1 (no token); the index tensors below point into it.
    Pieces no row uses are None.
    """

    token_source: torch.Tensor  # [num_source] int64
    # structured output: rows with a grammar and their masks (bit v % 32 of word v // 32)
    grammar_rows: torch.Tensor | None  # [G] int64, rows of the logits
    grammar_bitmask: torch.Tensor | None  # [G, ceil(V / 32)] int32
    # additive pieces: logit_bias, and -inf for min_tokens and one-token bad words
    add_rows: torch.Tensor | None  # [A] int64, rows of the logits
    add_ids: torch.Tensor | None  # [A] int64, token ids
    add_values: torch.Tensor | None  # [A] float32 (duplicates add up)
    # allowed_token_ids: rows restricted to a set, and the (row, token) pairs they allow
    allowed_rows: torch.Tensor | None  # [Ra] int64, rows of the logits
    allowed_pair_rows: torch.Tensor | None  # [N] int64, index into allowed_rows
    allowed_ids: torch.Tensor | None  # [N] int64
    # bad words of several tokens: one entry per (row, bad word)
    bad_rows: torch.Tensor | None  # [Pb] int64, rows of the logits
    bad_ids: torch.Tensor | None  # [Pb] int64, the bad word's last token
    bad_prefix: torch.Tensor | None  # [Pb, L] int64, the tokens before it, right-aligned, WILDCARD
    bad_context: torch.Tensor | None  # [Pb, L] int64, index into token_source: the row's last L
    # penalties: rows that use them, their slots in the per-slot state, their parameters
    penalty_rows: torch.Tensor | None  # [P] int64, rows of the logits
    penalty_slots: torch.Tensor | None  # [P] int64, rows of output_counts / prompt_mask
    repetition: torch.Tensor | None  # [P] float32, 1 = off (None: off in every row)
    frequency: torch.Tensor | None  # [P] float32 (None: 0 in every row)
    presence: torch.Tensor | None  # [P] float32 (None: 0 in every row)
    draft_count_rows: torch.Tensor | None  # [D] int64, index into penalty_rows
    draft_count_source: torch.Tensor | None  # [D] int64, index into token_source: a draft
    output_counts: torch.Tensor | None  # [max_num_seqs, V] int32, committed output per slot
    prompt_mask: torch.Tensor | None  # [max_num_seqs, V] bool, tokens of the prompt per slot


def apply_options(logits: torch.Tensor, options: OptionTensors,
                  token_bitmask: Callable[..., None] | None = None) -> torch.Tensor:
    """The logits after the rows' sampling options (see the module docstring).

    Parameters
    ----------
    logits : [R, V] float32 / bfloat16 / float16, one row per sampled or verified position
    options : OptionTensors for those R rows, on the logits' device
    token_bitmask : the op that applies the grammar rows' masks in place, with
        ``apply_token_bitmask``'s signature (the engine passes its device's kernel,
        ``verispec.ops.apply_token_bitmask``); default ``apply_token_bitmask`` (this module's)

    Returns
    -------
    [R, V] float32, a new tensor (``logits`` is left as it is).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {list(logits.shape)}")
    out = logits.to(torch.float32, copy=True)
    o = options
    if o.grammar_rows is not None:
        (token_bitmask or apply_token_bitmask)(out, o.grammar_rows, o.grammar_bitmask)
    if o.allowed_rows is not None:
        blocked = torch.ones((o.allowed_rows.shape[0], out.shape[1]), dtype=torch.bool,
                             device=out.device)
        blocked[o.allowed_pair_rows, o.allowed_ids] = False
        out[o.allowed_rows] = out[o.allowed_rows].masked_fill(blocked, NEG_INF)
    rows, ids, values = o.add_rows, o.add_ids, o.add_values
    if o.bad_rows is not None:
        context = o.token_source[o.bad_context]  # [Pb, L]
        match = ((o.bad_prefix == WILDCARD) | (context == o.bad_prefix)).all(-1)  # [Pb]
        bad = torch.where(match, NEG_INF, 0.0).to(torch.float32)
        rows = o.bad_rows if rows is None else torch.cat([rows, o.bad_rows])
        ids = o.bad_ids if ids is None else torch.cat([ids, o.bad_ids])
        values = bad if values is None else torch.cat([values, bad])
    if rows is not None:
        out.index_put_((rows, ids), values, accumulate=True)
    if o.penalty_rows is not None:
        out[o.penalty_rows] = _penalize(out[o.penalty_rows], o)
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                        token_ids: torch.Tensor | None = None, *, kernels=None) -> None:
    """Mask, in place, every token a row's bitmask does not allow: ``logits[rows[g], v] = -inf``
    unless bit t % 32 of ``bitmask[g, t // 32]`` is set, t the token id of column v (the grammar
    masks of structured output; model-based proposers apply them to their own logits too,
    docs/design.md §15).

    Parameters
    ----------
    logits : [R, V'] float, modified in place
    rows : [G] int64, rows of ``logits``
    bitmask : [G, ceil(V / 32)] int32, over the token ids
    token_ids : [V'] int64 or None
        The token id of each column (an EAGLE-3 head's draft vocabulary mapped onto the
        target's); None: column v is token v (V' = V).
    kernels : the compiled CPU kernels (``verispec.ops.cpu_kernels``) or None: float32 CPU
        logits are then masked by ``cpu_kernels.token_bitmask``, the same values
    """
    num_rows, num_words = bitmask.shape
    if (kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.stride(-1) == 1 and logits.shape[1] <= 32 * num_words):
        kernels.token_bitmask(logits, rows, bitmask, token_ids)
        return
    if logits.device.type == "cpu":  # numpy unpacks bits an order of magnitude faster
        bits = torch.from_numpy(np.unpackbits(
            bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little"))
    else:  # bit j of byte i is token 8 i + j (little endian words)
        shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
        bits = (bitmask.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1
    bits = bits.view(num_rows, num_words * 32)  # [G, 32 W] uint8, column t = token t
    refused = (bits[:, : logits.shape[1]] if token_ids is None else bits[:, token_ids]) == 0
    logits[rows] = logits[rows].masked_fill(refused, NEG_INF)


def apply_penalties(
    logits: torch.Tensor,  # [B * S, V] float32, modified in place
    token_ids: torch.Tensor,  # [B, S] int64, the step's input ids: last token, d_1 .. d_{S-1}
    slots: torch.Tensor,  # [B] int64, rows of the counts; -1: the request has no penalty here
    params: torch.Tensor,  # [B, 3] float32: repetition, frequency, presence
    output_counts: torch.Tensor,  # [N, V] int32, committed output per slot
    prompt_mask: torch.Tensor,  # [N, V] bool, tokens of the prompt per slot
) -> None:
    """The penalties of ``apply_options`` on a captured step's logits, in place: row i of
    request b counts its committed output plus ``token_ids[b, 1..i]`` (the drafts before it).
    Rows of requests with slot -1 are left as they are. Capturable (no host sync, no shape that
    depends on values); the Triton twin (``ops.triton_options``) gives the same bits."""
    B, S = token_ids.shape
    V = logits.shape[1]
    on = slots >= 0  # [B]
    counts = output_counts[slots.clamp_min(0)]  # [B, V] int32, a copy
    counts = counts[:, None, :].expand(B, S, V).clone()  # [B, S, V]
    if S > 1:  # row i adds drafts 1..i: a running sum of one-hot drafts
        drafts = torch.zeros((B, S, V), dtype=counts.dtype, device=counts.device)
        drafts[:, 1:].scatter_(2, token_ids[:, 1:, None], 1)
        counts += drafts.cumsum(1, dtype=counts.dtype)
    counts = counts.view(B * S, V)
    present = counts > 0
    seen = present | prompt_mask[slots.clamp_min(0)].repeat_interleave(S, 0)
    rows = params.repeat_interleave(S, 0)  # [B * S, 3]
    rep, freq, pres = rows[:, 0:1], rows[:, 1:2], rows[:, 2:3]
    z = logits
    penalised = torch.where(seen, torch.where(z > 0, z / rep, z * rep), z)
    penalised = penalised - freq * counts
    penalised = penalised - pres * present
    logits.copy_(torch.where(on.repeat_interleave(S, 0)[:, None], penalised, z))


def _penalize(z: torch.Tensor, o: OptionTensors) -> torch.Tensor:
    """[P, V] logits of the penalty rows -> penalised (repetition, frequency, presence)."""
    counts = o.output_counts[o.penalty_slots]  # [P, V] int32, a copy
    if o.draft_count_rows is not None:
        tokens = o.token_source[o.draft_count_source]  # [D] int64, -1 = no draft there
        counts.index_put_((o.draft_count_rows, tokens.clamp_min(0)),
                          (tokens >= 0).to(counts.dtype), accumulate=True)
    present = counts > 0
    if o.repetition is not None:
        seen = present | o.prompt_mask[o.penalty_slots]
        rep = o.repetition[:, None]
        z = torch.where(seen, torch.where(z > 0, z / rep, z * rep), z)
    if o.frequency is not None:
        z = z - o.frequency[:, None] * counts
    if o.presence is not None:
        z = z - o.presence[:, None] * present
    return z
