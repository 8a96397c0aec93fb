"""The Mamba2 layer on the flat token layout of a GPU step (``verispec.ops.model_ops``): the
hybrid model's decode and verify steps as device work only, capturable in a CUDA graph.

The per-slot state ring (``verispec.models.mamba2.MambaLayerState``) is a static buffer of the
cache with one more slot, the scratch slot, as the attention KV cache has: the rows that pad a
batch up to its graph's bucket read and write there. A step of B requests feeding up to S tokens
each runs on a padded ``[B, S]`` view of its tokens (a reshape when every request feeds S tokens,
as in a replayed graph; a gather otherwise):

- the conv state at each request's committed length is gathered from the ring (zeros for an
  empty slot), the conv, dt, the decays and dt * B computed elementwise for all tokens
  (``Mamba2Mixer.step_inputs``, shared with the CPU path);
- the SSM state update runs token by token inside one kernel (``ModelOps.ssm_state_update``:
  ``verispec.ops.triton_ssm``, its torch twin on CPU), reading each request's number of real
  tokens on the device, so padding tokens of a fixed-shape step leave every state alone;
- the conv state after each real token is scattered into the ring entry of its length; padding
  tokens' scatters go to the scratch slot (a device ``where``, no boolean indexing).

So a captured step reads and writes only static buffers, and no host value depends on the
batch's contents. Rollback is the CPU path's: the state after L tokens is at ring index
``L % ring_size``, and the engine moves the slot's length (``verispec.runtime.state_cache``).

Long feeds (more than ``MAX_RECURRENT_TOKENS`` tokens for a request: prefills, always eager) go
through the chunked scan one request at a time and their last token through the recurrent form,
as on CPU; a forward that holds one reads the layout on the host once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from verispec import ops
from verispec.models.layout import FlatBatch
from verispec.models.mamba2 import (
    MAX_RECURRENT_TOKENS,
    Mamba2Mixer,
    MambaLayerState,
    pointwise,
)


@dataclass
class ChunkedFeed:
    """A request fed through the chunked scan: tokens ``[begin, begin + n)`` of the step, slot
    ``slot`` holding ``start`` tokens before it (host values)."""

    begin: int
    n: int
    slot: int
    start: int


@dataclass
class FlatMambaStep:
    """What every Mamba2 layer of one flat forward shares (built once per forward, ``build``).

    The recurrent form runs the B requests on a padded [B, S] view of their tokens (of a long
    feed, its last token only); ``pad_index`` maps it to token indices (None: the T tokens are
    that view already), ``out_rows`` picks the rows of real tokens (None: every row) and
    ``out_tokens`` says which tokens they are (None: every token, in order)."""

    slots: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int64: each request's length before its recurrent tokens
    counts: torch.Tensor  # [B] int64 >= 1: its real recurrent tokens (<= S)
    num_queries: int  # S
    read_entries: torch.Tensor  # [B] int64: ring index of the state at ``starts``
    has_state: torch.Tensor  # [B, 1, 1] bool: starts > 0 (else zero states)
    write_slots: torch.Tensor  # [B, S] int64: slot of the conv state after token s (scratch
    #   slot for padding tokens and for tokens the ring does not keep)
    write_entries: torch.Tensor  # [B, S] int64: its ring index
    pad_index: torch.Tensor | None  # [B, S] int64 token index of each padded position
    out_tokens: torch.Tensor | None  # [T_r] int64 tokens the recurrent form computes
    out_rows: torch.Tensor | None  # [T_r] int64 their rows in the padded [B * S] view
    chunked: list[ChunkedFeed]

    @classmethod
    def build(cls, batch: FlatBatch, num_tokens: int, counts: torch.Tensor | None,
              state: MambaLayerState) -> FlatMambaStep:
        """From the flat layout of ``batch`` (T = ``num_tokens`` tokens) and, for a fixed-shape
        step whose requests feed fewer real tokens than their layout holds, ``counts`` [B]
        (device). Without a long feed (at most MAX_RECURRENT_TOKENS per request, known from
        ``max_queries``): device ops only (capturable)."""
        device = batch.slot_ids.device
        B, S = batch.slot_ids.shape[0], batch.max_queries
        layout_counts = batch.query_start[1:] - batch.query_start[:-1]  # [B]
        starts = batch.context_lens - layout_counts
        counts = layout_counts if counts is None else counts
        if S <= MAX_RECURRENT_TOKENS:
            pad_index = out_rows = None
            if num_tokens != B * S:  # requests of different lengths: gather into [B, S]
                offsets = torch.arange(S, device=device)
                pad_index = batch.query_start[:-1, None] + torch.minimum(
                    offsets, (layout_counts - 1)[:, None])
                tokens = torch.arange(num_tokens, device=device)
                rows = torch.searchsorted(batch.query_start[1:], tokens, right=True)
                out_rows = rows * S + tokens - batch.query_start[rows]
            return cls._make(batch.slot_ids, starts, counts, S, state, pad_index, None,
                             out_rows, [])
        # A long feed (eager): the chunked scan over all but its last token, which joins the
        # recurrent form from the state the scan leaves (as on the CPU path); on the host.
        first = batch.query_start.cpu().numpy()[:-1]
        counts_np = counts.cpu().numpy()
        slots_np, starts_np = batch.slot_ids.cpu().numpy(), starts.cpu().numpy()
        long = counts_np > MAX_RECURRENT_TOKENS
        chunked = [ChunkedFeed(int(first[b]), int(counts_np[b]) - 1, int(slots_np[b]),
                               int(starts_np[b])) for b in np.flatnonzero(long)]
        skipped = np.where(long, counts_np - 1, 0)  # tokens the chunked scan took
        first, starts_np, counts_np = first + skipped, starts_np + skipped, counts_np - skipped
        S = int(counts_np.max())
        offsets = np.arange(S)
        pad_index = first[:, None] + np.minimum(offsets, counts_np[:, None] - 1)  # [B, S]
        valid = offsets[None, :] < counts_np[:, None]

        def dev(a: np.ndarray) -> torch.Tensor:
            return ops.to_device(np.ascontiguousarray(a, dtype=np.int64), device)

        return cls._make(batch.slot_ids, dev(starts_np), dev(counts_np), S, state,
                         dev(pad_index), dev(pad_index[valid]), dev(np.flatnonzero(valid)),
                         chunked)

    @classmethod
    def _make(cls, slots, starts, counts, S, state, pad_index, out_tokens, out_rows, chunked):
        ring_size, scratch = state.ring_size, state.scratch_slot
        if scratch is None:
            raise ValueError("the flat layout needs a state cache with a scratch slot "
                             "(HybridCache with extra_rows > 0)")
        offsets = torch.arange(S, device=slots.device)
        # The ring keeps the last ring_size lengths: of a feed longer than the ring only the
        # last ring_size tokens' states are stored (one scatter never hits an entry twice).
        kept = (offsets < counts[:, None]) & (offsets >= (counts - ring_size)[:, None])
        return cls(
            slots=slots, starts=starts, counts=counts, num_queries=S,
            read_entries=starts % ring_size, has_state=(starts > 0)[:, None, None],
            write_slots=torch.where(kept, slots[:, None], scratch),
            write_entries=(starts[:, None] + offsets + 1) % ring_size,
            pad_index=pad_index, out_tokens=out_tokens, out_rows=out_rows, chunked=chunked)


def mixer_forward_flat(mixer: Mamba2Mixer, h: torch.Tensor, batch: FlatBatch,
                       step: FlatMambaStep, state: MambaLayerState) -> torch.Tensor:
    """The Mamba2 layer over the T tokens ``h`` [T, hidden] of a flat step (module docstring).
    Returns [T, hidden] in h's dtype; the states after the tokens are in ``state``'s ring."""
    ops = batch.ops
    T = h.shape[0]
    proj = ops.linear(h, mixer.in_proj_weight, mixer.in_proj_bias)
    z, xBC, dt = proj.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    y_chunked = None
    if step.chunked:  # before the recurrent form, which continues from their states
        y_chunked = h.new_zeros(T, mixer.intermediate_size, dtype=torch.float32)
        for feed in step.chunked:
            _chunked(mixer, feed, xBC, dt, y_chunked, state)
    y = _recurrent(mixer, xBC, dt, step, state, ops.ssm_state_update)
    y = y.reshape(-1, mixer.intermediate_size)  # [G * S, I]
    if step.out_rows is not None:
        y = y[step.out_rows]
    if y_chunked is not None:
        y_chunked[step.out_tokens] = y
        y = y_chunked
    # Gated RMSNorm over groups of intermediate_size / groups channels, in float32: the norm's
    # statistics through ops.rms_norm (a row's sum in one fixed order, whatever T).
    G = mixer.num_groups
    gated = (y * pointwise(F.silu, z.float())).view(T * G, -1)
    normed = ops.rms_norm(gated, _ones(mixer, gated.shape[-1], gated.device), mixer.eps)
    out = (mixer.norm_weight.float() * normed.view(T, -1)).to(h.dtype)
    return ops.linear(out, mixer.out_proj_weight, mixer.out_proj_bias)


def _ones(mixer: Mamba2Mixer, size: int, device: torch.device) -> torch.Tensor:
    """A float32 ones vector (the unit weight of the group norm), made once per mixer and
    device and kept: a captured step reads the tensor of its warm-up run."""
    if not hasattr(mixer, "_unit_norm_weights"):
        mixer._unit_norm_weights = {}
    key = (size, torch.device(device))
    if key not in mixer._unit_norm_weights:
        mixer._unit_norm_weights[key] = torch.ones(size, dtype=torch.float32, device=device)
    return mixer._unit_norm_weights[key]


def _recurrent(mixer: Mamba2Mixer, xBC: torch.Tensor, dt: torch.Tensor, step: FlatMambaStep,
               state: MambaLayerState, update) -> torch.Tensor:
    """The recurrent form of the step's B requests: y [B, S, intermediate_size] float32."""
    G, S = step.slots.shape[0], step.num_queries
    if step.pad_index is None:
        xBC, dt = xBC.reshape(G, S, -1), dt.reshape(G, S, -1)
    else:
        xBC, dt = xBC[step.pad_index], dt[step.pad_index]
    conv = state.conv[step.slots, step.read_entries]  # [G, d_conv - 1, conv_dim]
    conv = torch.where(step.has_state, conv, 0.0)
    ext = torch.cat((conv, xBC.float()), dim=1)  # [G, d_conv - 1 + S, conv_dim]
    xs, dtB, decay, Cs = mixer.step_inputs(ext, dt)
    ys = update(state.ssm, step.slots, step.starts, step.counts, xs, dtB, decay, Cs)
    # The conv state after token s is rows s + 1 .. s + d_conv - 1 of ext.
    windows = ext.unfold(1, mixer.d_conv - 1, 1).transpose(2, 3)[:, 1:]  # [G, S, K - 1, conv]
    state.conv.index_put_((step.write_slots, step.write_entries), windows)
    y = ys.transpose(0, 1) + xs.transpose(0, 1) * mixer.D.float()[:, None]  # [G, S, H, P]
    return y.reshape(G, S, mixer.intermediate_size)


def _chunked(mixer: Mamba2Mixer, feed: ChunkedFeed, xBC: torch.Tensor, dt: torch.Tensor,
             y: torch.Tensor, state: MambaLayerState) -> None:
    """One long feed through the chunked scan (eager; host indices); its final states into the
    ring."""
    entry = (feed.slot, feed.start % state.ring_size)
    conv, ssm = state.conv[entry], state.ssm[entry]
    if feed.start == 0:
        conv, ssm = torch.zeros_like(conv), torch.zeros_like(ssm)
    tokens = slice(feed.begin, feed.begin + feed.n)
    y[tokens], conv_end, ssm_end = mixer.chunked_feed(xBC[tokens], dt[tokens], conv, ssm)
    end = (feed.slot, (feed.start + feed.n) % state.ring_size)
    state.conv[end], state.ssm[end] = conv_end, ssm_end
