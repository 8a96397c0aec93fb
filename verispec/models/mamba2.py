"""The Mamba2 layer of the hybrid models (``verispec.models.granite_hybrid``) in torch, and its
recurrent state per request slot.

The Mamba2 mixer (per token t, head h, head dim p, state n; ``A = -exp(A_log)``)::

    z, xBC, dt  = in_proj(x_t)                  gate, conv input, one step size per head
    x, B, C     = silu(causal_conv1d(xBC))      depthwise conv over the last d_conv inputs
    dt          = clamp(softplus(dt + dt_bias), time_step_limit)
    h_t         = exp(dt * A) * h_{t-1} + dt * x_t (outer) B_t        [heads, head_dim, d_state]
    y_t         = C_t . h_t + D * x_t
    out         = out_proj(rmsnorm_grouped(y * silu(z)) * norm_weight)

Two forms compute it, chosen per request by its own number of new tokens in the forward (so a
request's result never depends on its batch, docs/design.md §12):

- **recurrent** (at most ``MAX_RECURRENT_TOKENS`` new tokens: decode, a verify step of k + 1 <= 33
  tokens, short prompts): the update above one token at a time, the state after every token
  written to the request's state ring (below); a verify step of k + 1 tokens runs exactly the
  ops of k + 1 one-token steps, so greedy speculation emits the plain greedy tokens bit for bit;
- **chunked** (longer prefills): the chunked scan of Mamba2 (state space duality): within a
  chunk of ``mamba_chunk_size`` tokens the output is a masked (C B^T * decay) matrix times
  ``dt * x`` plus the decayed chunk-start state read by C; the state is carried from chunk to
  chunk. It runs over all but the last token, which then takes the recurrent form: the states
  after the feed's last two tokens are kept (a captured draft that re-feeds the last committed
  token starts from the one before it, ``verispec.proposers.draft_model``).

Recurrent state per request slot (``MambaLayerState``, docs/design.md §6): the conv state (the last
d_conv - 1 conv inputs) and the SSM state, kept for the last ``ring_size`` lengths of the slot in
a ring indexed by ``length % ring_size``. The state after a slot's first L tokens is at ring index
``L % ring_size``. A verify step of k + 1 tokens from length b writes the states after every
position (lengths b + 1 .. b + k + 1); committing ``num_output_tokens`` tokens then leaves the
slot at length ``b + num_output_tokens`` and the next step reads the state at that length (index
``num_output_tokens - 1`` of the step's positions), so rollback is moving the length back, as for
the attention KV cache. Which lengths a slot still holds is the cache's to track
(``verispec.runtime.state_cache``); a forward from length 0 starts from zero states.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.config import HybridModelConfig
from verispec.models.layers import _param
from verispec.models.layout import AttentionMetadata
from verispec.ops.cpu_linear import linear
from verispec.ops.model_ops import ssm_state_update

# A request feeding at most this many new tokens in a forward runs the recurrent form (33: a
# verify step of k + 1 tokens with k <= 32, SpeculativeConfig's cap); more run the chunked scan.
MAX_RECURRENT_TOKENS = 33


# Elementwise transcendental ops (exp, softplus, silu, rsqrt) run on buffers padded to a multiple
# of this many elements: torch's CPU loops compute full vectors with SLEEF and a remainder with
# the scalar libm function, which can differ in the last bit, so without padding a value's bits
# would depend on how many tokens share its tensor (a decode step against a verify step).
POINTWISE_ALIGN = 64


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, every element through the vectorised loop."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n % POINTWISE_ALIGN:
        flat = F.pad(flat, (0, POINTWISE_ALIGN - n % POINTWISE_ALIGN))
    return fn(flat.contiguous())[:n].view(x.shape)


def stores_every_position(num_new_tokens: int | np.ndarray) -> bool | np.ndarray:
    """Whether a forward feeding a request ``num_new_tokens`` tokens writes the state after each
    of them (recurrent form) or only after the last (chunked scan); elementwise for an array."""
    return num_new_tokens <= MAX_RECURRENT_TOKENS


@dataclass
class MambaLayerState:
    """One Mamba2 layer's recurrent state for every slot, for the last ``ring_size`` lengths of
    each slot: the state after a slot's first L tokens lives at ring index ``L % ring_size``.

    The conv state is token-major (one contiguous row of conv inputs per token), so the conv of a
    step runs over contiguous channels and the state after each of its tokens is a window of
    rows of the step's inputs, stored without a gather."""

    conv: torch.Tensor  # [rows, ring_size, d_conv - 1, conv_dim] float32: last conv inputs
    ssm: torch.Tensor  # [rows, ring_size, heads, head_dim, d_state] float32
    # rows = num_slots, or num_slots + 1 with the scratch slot of fixed-shape (GPU) steps
    scratch_slot: int | None = None

    @classmethod
    def allocate(cls, config: HybridModelConfig, num_slots: int, ring_size: int,
                 device: torch.device | str, scratch_slot: bool = False) -> MambaLayerState:
        """Zero states for ``num_slots`` slots, plus the scratch slot (index ``num_slots``)
        where the padding rows of a fixed-shape step read and write."""
        c = config
        rows = num_slots + scratch_slot
        return cls(
            torch.zeros(rows, ring_size, c.mamba_d_conv - 1, c.mamba_conv_dim,
                        dtype=torch.float32, device=device),
            torch.zeros(rows, ring_size, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state,
                        dtype=torch.float32, device=device),
            num_slots if scratch_slot else None,
        )

    @property
    def ring_size(self) -> int:
        return self.conv.shape[1]

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()
                + self.ssm.numel() * self.ssm.element_size())

    def read(self, slots: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv [G, d_conv - 1, conv_dim] and SSM [G, heads, head_dim, d_state] states after
        ``lengths[g]`` tokens of ``slots[g]`` (zeros for length 0): views of the ring for one
        request (read-only for the caller), copies for several."""
        if slots.size == 1 and lengths[0] > 0:
            entry = (int(slots[0]), int(lengths[0] % self.ring_size))
            return self.conv[entry][None], self.ssm[entry][None]
        index = (torch.from_numpy(slots), torch.from_numpy(lengths % self.ring_size))
        conv, ssm = self.conv[index], self.ssm[index]
        empty = lengths == 0
        if empty.any():
            rows = torch.from_numpy(np.flatnonzero(empty))
            conv[rows], ssm[rows] = 0.0, 0.0
        return conv, ssm

    def read_conv(self, slots: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """The conv states alone (see ``read``)."""
        if slots.size == 1 and lengths[0] > 0:
            return self.conv[int(slots[0]), int(lengths[0] % self.ring_size)][None]
        conv = self.conv[torch.from_numpy(slots), torch.from_numpy(lengths % self.ring_size)]
        conv[torch.from_numpy(lengths == 0)] = 0.0
        return conv

    def write(self, slots: np.ndarray, lengths: np.ndarray, conv: torch.Tensor,
              ssm: torch.Tensor) -> None:
        """Store the states after ``lengths[g]`` tokens of ``slots[g]``."""
        self.write_conv(slots, lengths, conv)
        self.write_ssm(slots, lengths, ssm)

    def write_conv(self, slots: np.ndarray, lengths: np.ndarray, conv: torch.Tensor) -> None:
        """``conv`` [n, d_conv - 1, conv_dim]: the conv states after ``lengths[i]`` tokens of
        ``slots[i]``."""
        index = (torch.from_numpy(slots), torch.from_numpy(lengths % self.ring_size))
        self.conv.index_put_(index, conv)

    def write_ssm(self, slots: np.ndarray, lengths: np.ndarray, ssm: torch.Tensor) -> None:
        index = (torch.from_numpy(slots), torch.from_numpy(lengths % self.ring_size))
        self.ssm.index_put_(index, ssm)


@dataclass
class HybridStep:
    """Per-request facts of one forward (host arrays), read once from its AttentionMetadata:
    request b feeds ``counts[b]`` tokens to ``slots[b]``, which held ``starts[b]`` tokens."""

    slots: np.ndarray  # [B] int64
    starts: np.ndarray  # [B] int64
    counts: np.ndarray  # [B] int64

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata, batch_size: int, width: int) -> HybridStep:
        """The runner lays request b's valid tokens out first in row b of a [B, width] batch;
        ``write_slots`` / ``write_positions`` hold the slot and position of each valid token."""
        slots_all = meta.write_slots.cpu().numpy()
        positions = meta.write_positions.cpu().numpy()
        if meta.valid_index is None:
            counts = np.full(batch_size, width, dtype=np.int64)
        else:
            rows = meta.valid_index.cpu().numpy() // width
            counts = np.bincount(rows, minlength=batch_size).astype(np.int64)
        first = np.zeros(batch_size, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        return cls(slots_all[first], positions[first], counts)


def chunk_scan(
    x: torch.Tensor,  # [n, heads, head_dim] float32
    dt: torch.Tensor,  # [n, heads] float32 (after softplus and clamp)
    A: torch.Tensor,  # [heads] float32, negative
    B: torch.Tensor,  # [n, heads, d_state] float32 (groups expanded to heads)
    C: torch.Tensor,  # [n, heads, d_state] float32
    D: torch.Tensor,  # [heads] float32
    state: torch.Tensor,  # [heads, head_dim, d_state] float32: the state before token 0
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over n tokens of one request, ``chunk_size`` at a time. Returns y [n, heads,
    head_dim] and the state after the last token [heads, head_dim, d_state], both float32.

    Within a chunk, with ``a_i = dt_i * A`` (log decay of step i) and ``seg[t, s] = a_{s+1} + .. +
    a_t`` (s <= t)::

        y_t     = sum_{s <= t} exp(seg[t, s]) (C_t . B_s) dt_s x_s     (the chunk's own tokens)
                + exp(a_0 + .. + a_t) C_t . h_start                     (the state it starts from)
                + D x_t
        h_end   = exp(a_0 + .. + a_last) h_start + sum_s exp(seg[last, s]) dt_s x_s (outer) B_s

    ``seg`` is a cumulative sum of masked steps (no difference of two long sums, which would
    cancel), set to -inf above the diagonal so exp gives the causal mask.
    """
    outputs = []
    for begin in range(0, x.shape[0], chunk_size):
        xc, dtc = x[begin:begin + chunk_size], dt[begin:begin + chunk_size]
        q = xc.shape[0]
        log_decay = (dtc * A).T  # [heads, q]
        strict = torch.ones(q, q, dtype=torch.bool, device=x.device).tril(-1)  # [t, s]: s < t
        steps = log_decay[:, :, None].expand(-1, q, q).masked_fill(~strict, 0.0)
        causal = strict.logical_or(torch.eye(q, dtype=torch.bool, device=x.device))
        seg = steps.cumsum(dim=1).masked_fill(~causal, float("-inf"))  # [heads, t, s]
        Bc = B[begin:begin + chunk_size].transpose(0, 1)  # [heads, q, d_state]
        Cc = C[begin:begin + chunk_size].transpose(0, 1)
        xdt = (xc * dtc[..., None]).transpose(0, 1)  # [heads, q, head_dim]
        scores = torch.bmm(Cc, Bc.transpose(1, 2)) * seg.exp()  # [heads, t, s]
        y = torch.bmm(scores, xdt)  # [heads, q, head_dim]
        from_start = log_decay.cumsum(dim=1)  # [heads, q]: a_0 + .. + a_t
        y += from_start.exp()[..., None] * torch.bmm(Cc, state.transpose(1, 2))
        to_end = seg[:, -1, :].exp()  # [heads, q]: exp(a_{s+1} + .. + a_last)
        state = (from_start[:, -1].exp()[:, None, None] * state
                 + torch.bmm((xdt * to_end[..., None]).transpose(1, 2), Bc))
        outputs.append(y.transpose(0, 1) + xc * D[:, None])
    return torch.cat(outputs), state


class Mamba2Mixer(nn.Module):
    """The Mamba2 layer (module docstring); parameters in HF's shapes."""

    def __init__(self, config: HybridModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.num_heads, self.head_dim, self.d_state = c.mamba_n_heads, c.mamba_d_head, \
            c.mamba_d_state
        self.num_groups, self.d_conv = c.mamba_n_groups, c.mamba_d_conv
        self.intermediate_size, self.conv_dim = c.mamba_intermediate_size, c.mamba_conv_dim
        self.chunk_size, self.time_step_limit = c.mamba_chunk_size, c.time_step_limit
        self.eps = c.rms_norm_eps
        proj = self.intermediate_size + self.conv_dim + self.num_heads  # z | xBC | dt
        self.in_proj_weight = _param(proj, c.hidden_size, dtype=dtype)
        self.in_proj_bias = _param(proj, dtype=dtype) if c.mamba_proj_bias else None
        self.conv_weight = _param(self.conv_dim, 1, self.d_conv, dtype=dtype)
        self.conv_bias = _param(self.conv_dim, dtype=dtype) if c.mamba_conv_bias else None
        self.dt_bias = _param(self.num_heads, dtype=dtype)
        self.A_log = _param(self.num_heads, dtype=dtype)
        self.D = _param(self.num_heads, dtype=dtype)
        self.norm_weight = _param(self.intermediate_size, dtype=dtype)
        self.out_proj_weight = _param(c.hidden_size, self.intermediate_size, dtype=dtype)
        self.out_proj_bias = _param(c.hidden_size, dtype=dtype) if c.mamba_proj_bias else None
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None  # see models.layers.set_cpu_matmuls

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        return linear(x, weight, bias, self.matmul_splits, self.upcast_rows, self.batch_invariant,
                      self.kernels)

    def _heads(self, BC: torch.Tensor) -> torch.Tensor:
        """[..., groups * d_state] -> [..., heads, d_state] (each group serves heads / groups)."""
        grouped = BC.view(*BC.shape[:-1], self.num_groups, 1, self.d_state)
        per_group = self.num_heads // self.num_groups
        return grouped.expand(*BC.shape[:-1], self.num_groups, per_group, self.d_state).reshape(
            *BC.shape[:-1], self.num_heads, self.d_state)

    def _split_xBC(self, xBC: torch.Tensor):
        size = self.num_groups * self.d_state
        return xBC.split([self.intermediate_size, size, size], dim=-1)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        lo, hi = self.time_step_limit
        return pointwise(F.softplus, dt.float() + self.dt_bias.float()).clamp(min=lo, max=hi)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        step: HybridStep,
        state: MambaLayerState,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        proj = self._linear(x, self.in_proj_weight, self.in_proj_bias)
        z, xBC, dt = proj.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        y = torch.zeros(B, S, self.intermediate_size, dtype=torch.float32, device=x.device)
        recurrent = stores_every_position(step.counts)
        if recurrent.any():
            self._recurrent(np.flatnonzero(recurrent), step, xBC, dt, y, state)
        long_rows = np.flatnonzero(~recurrent)
        if long_rows.size:
            for b in long_rows.tolist():  # all but the last token
                self._chunked(b, step, xBC, dt, y, state)
            # the last token in the recurrent form, from the state the scan left
            last = step.counts[long_rows] - 1
            tail = HybridStep(step.slots[long_rows], step.starts[long_rows] + last,
                              np.ones_like(last))
            rows, cols = torch.from_numpy(long_rows), torch.from_numpy(last)
            y_tail = y.new_zeros(long_rows.size, 1, self.intermediate_size)
            self._recurrent(np.arange(long_rows.size), tail, xBC[rows, cols][:, None],
                            dt[rows, cols][:, None], y_tail, state)
            y[rows, cols] = y_tail[:, 0]
        # Gated RMSNorm over groups of intermediate_size / groups channels, in float32.
        gated = (y * pointwise(F.silu, z.float())).view(B, S, self.num_groups, -1)
        gated = gated * pointwise(torch.rsqrt, gated.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.norm_weight.float() * gated.view(B, S, -1)).to(x.dtype)
        return self._linear(out, self.out_proj_weight, self.out_proj_bias)

    def _recurrent(self, rows: np.ndarray, step: HybridStep, xBC: torch.Tensor, dt: torch.Tensor,
                   y: torch.Tensor, state: MambaLayerState) -> None:
        """Requests ``rows`` one token at a time; the state after each token into the ring.

        Everything that does not depend on the SSM state (the conv, whose inputs are all known,
        dt, the decays, dt * B) is computed for all the step's tokens at once with elementwise
        ops, so a token's bits do not depend on how many tokens share the step; only the state
        update and its read-out run token by token."""
        slots, starts, counts = step.slots[rows], step.starts[rows], step.counts[rows]
        G, S = rows.size, int(counts.max())
        K = self.d_conv
        every_row = G == xBC.shape[0]
        index = slice(None) if every_row else torch.from_numpy(rows)
        # The conv inputs, token-major: the d_conv - 1 before the step, then the step's own.
        ext = torch.cat((state.read_conv(slots, starts), xBC[index, :S].float()), dim=1)
        xs, dtB, decay, Cs = self.step_inputs(ext, dt[index, :S])
        ys = ssm_state_update(state.ssm, torch.from_numpy(slots), torch.from_numpy(starts),
                              torch.from_numpy(counts), xs, dtB, decay, Cs)  # [S, G, H, P]
        xs = xs.transpose(0, 1)  # [G, S, H, P]
        # The conv state after token s is rows s + 1 .. s + d_conv - 1 of ext: windows[:, s + 1]
        # (views). Kept: tokens counts - num_kept .. counts - 1 of each request (the ring's
        # last lengths), gathered in one copy.
        windows = ext.unfold(1, K - 1, 1).transpose(2, 3)  # [G, S + 1, d_conv - 1, conv_dim]
        num_kept = np.minimum(counts, state.ring_size)
        g_index = np.repeat(np.arange(G), num_kept)
        s_index = np.arange(num_kept.sum()) - np.repeat(np.cumsum(num_kept) - counts, num_kept)
        state.write_conv(slots[g_index], starts[g_index] + s_index + 1,
                         windows[torch.from_numpy(g_index), torch.from_numpy(s_index + 1)])
        y[index, :S] = (ys.transpose(0, 1) + xs * self.D.float()[:, None]).reshape(
            G, S, self.intermediate_size)

    def step_inputs(self, ext: torch.Tensor, dt: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The operands of ``ssm_state_update`` for G requests of S tokens each, from ``ext``
        [G, d_conv - 1 + S, conv_dim] float32 (the conv inputs before the step, then the step's
        own) and ``dt`` [G, S, heads] (the projection's step sizes). Returns x [S, G, heads,
        head_dim], dt * B and C [S, G, heads, d_state], decay [S, G, heads], all float32 and
        token-major contiguous: token s is a contiguous [G * heads, ...] block, so the update's
        matrix products take the same path at every step. Elementwise ops only (the conv as
        ordered sums over its taps): a token's bits do not depend on G or S."""
        G, S = dt.shape[:2]
        K = self.d_conv
        weight = self.conv_weight.float().view(self.conv_dim, K)
        conv_out = ext[:, :S] * weight[:, 0]  # w_0 x_{t-K+1} + .. + w_{K-1} x_t, in order
        for j in range(1, K):
            conv_out = conv_out + ext[:, j:j + S] * weight[:, j]
        if self.conv_bias is not None:
            conv_out = conv_out + self.conv_bias.float()
        xs, Bs, Cs = self._split_xBC(pointwise(F.silu, conv_out))  # [G, S, *]
        xs = xs.reshape(G, S, self.num_heads, self.head_dim)
        steps = self._dt(dt)  # [G, S, heads]
        decay = pointwise(torch.exp, steps * -torch.exp(self.A_log.float()))
        dtB = steps[..., None] * self._heads(Bs)  # [G, S, heads, d_state]
        return (xs.transpose(0, 1).contiguous(), dtB.transpose(0, 1).contiguous(),
                decay.transpose(0, 1).contiguous(), self._heads(Cs).transpose(0, 1).contiguous())

    def _chunked(self, b: int, step: HybridStep, xBC: torch.Tensor, dt: torch.Tensor,
                 y: torch.Tensor, state: MambaLayerState) -> None:
        """All but the last token of request ``b`` (one long feed) through the chunked scan;
        only the state after them kept."""
        n = int(step.counts[b]) - 1
        slots, starts = step.slots[b:b + 1], step.starts[b:b + 1]
        conv, ssm = state.read(slots, starts)
        y[b, :n], conv_end, ssm_end = self.chunked_feed(xBC[b, :n], dt[b, :n], conv[0], ssm[0])
        state.write(slots, starts + n, conv_end[None], ssm_end[None])

    def chunked_feed(self, xBC: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
                     ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's n new tokens through the chunked scan: ``xBC`` [n, conv_dim] and
        ``dt`` [n, heads] of the projection, from the conv state ``conv`` [d_conv - 1,
        conv_dim] and SSM state ``ssm`` [heads, head_dim, d_state] (float32). Returns y [n,
        intermediate_size] and the conv and SSM states after the last token, float32."""
        n = xBC.shape[0]
        # The conv over [previous d_conv - 1 inputs, the n new ones], no padding.
        inputs = torch.cat((conv.T, xBC.float().T), dim=-1)  # [conv_dim, d_conv - 1 + n]
        conv_out = F.conv1d(inputs[None], self.conv_weight.float(),
                            None if self.conv_bias is None else self.conv_bias.float(),
                            groups=self.conv_dim)[0].T  # [n, conv_dim]
        xs, Bs, Cs = self._split_xBC(F.silu(conv_out))
        ys, final = chunk_scan(
            xs.reshape(n, self.num_heads, self.head_dim), self._dt(dt),
            -torch.exp(self.A_log.float()), self._heads(Bs), self._heads(Cs), self.D.float(),
            ssm, self.chunk_size)
        return ys.reshape(n, self.intermediate_size), inputs[:, n:].T, final
