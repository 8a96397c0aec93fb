"""The EAGLE-3 training recipe: training-time test (TTT) over a batch of the target's sequences.

A head's inference (``verispec.proposers.eagle``) feeds it, at head position p, the token at
p + 1 with the target's hidden state of p (the committed context), then its own output hidden
state with each draft. Training unrolls the same thing over every position t of a sequence at
once, ``num_steps`` times:

    step 0:  input (x_{t+1}, fc(aux_t)) at RoPE position t           -> predicts x_{t+2}
    step j:  input (x_{t+1+j}, out_{j-1}[t]) at RoPE position t + j  -> predicts x_{t+2+j}

and step j's query at t attends to step 0's keys at positions <= t (the context, fed with the
target's hidden states) and to the keys of steps 1..j at t alone (the drafts before it): exactly
the rows a draft at position t + j sees in the head's KV cache. The label of a prediction is the
target's own distribution there (its final-norm hidden state through its LM head, restricted to
the draft vocabulary and renormalised); the loss is the cross-entropy of the head's distribution
against it, step j weighted by ``0.8 ** j``; accuracy is argmax agreement.

Plain torch with autograd (the inference matmul kernels have no backward); the parameters are
the ``EagleHead``'s own, so a trained head is saved and loaded as any other.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from verispec.models.eagle import EagleHead
from verispec.models.rope import apply_rope, rope_tables
from verispec.ops.quant import QuantizedWeight

STEP_DECAY = 0.8
# Rows of the loss computed at once: [32, V_draft] float32 temporaries stay in a core's cache
# (the whole [N, V_draft] products would stream through memory several times a step)
LOSS_CHUNK = 32


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """SDPA of [B, hq, S, d] queries over [B, hkv, N, d] keys and values with a [S, N] mask. On
    a CPU in float32 even under bfloat16 autocast: torch's CPU flash attention, backward
    included, is faster in float32 there."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              scale=scale, enable_gqa=gqa)


class _SoftCrossEntropy(torch.autograd.Function):
    """Sum over rows of the cross-entropy of softmax(logits) against softmax(target), and the
    number of rows whose argmaxes agree; [N, V] logits of any float dtype, computed in float32
    over chunks of ``LOSS_CHUNK`` rows. The gradient is ``softmax(logits) - softmax(target)``,
    recomputed chunk by chunk in the backward pass: nothing of size [N, V] is kept or built
    beyond the gradient itself, which keeps a CPU training step's memory traffic small."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor):
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        agree = torch.zeros((), dtype=torch.int64, device=logits.device)
        for lo in range(0, logits.shape[0], LOSS_CHUNK):
            mine, theirs = logits[lo:lo + LOSS_CHUNK].float(), target[lo:lo + LOSS_CHUNK].float()
            p = torch.softmax(theirs, dim=-1)
            # -sum p log q = logsumexp(logits) - sum p * logits, with sum p = 1
            total += (torch.logsumexp(mine, dim=-1) - (p * mine).sum(-1)).sum()
            agree += (mine.max(-1).indices == theirs.max(-1).indices).sum()
        ctx.save_for_backward(logits, target)
        ctx.mark_non_differentiable(agree)
        return total, agree

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_agree):
        logits, target = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], LOSS_CHUNK):
            rows = slice(lo, lo + LOSS_CHUNK)
            diff = (torch.softmax(logits[rows].float(), dim=-1)
                    - torch.softmax(target[rows].float(), dim=-1))
            grad[rows] = diff * grad_total
        return grad, None


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """(sum of the rows' cross-entropies of softmax(logits) against softmax(target), number of
    rows whose argmaxes agree) for [N, V] ``logits`` and ``target`` logits."""
    return _SoftCrossEntropy.apply(logits, target)


class LayerWeights(NamedTuple):
    """A target decoder layer's weights, dense (``init_head`` starts the head's layer as it)."""

    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [H, Hq D]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]
    input_norm: torch.Tensor  # [H]
    post_attn_norm: torch.Tensor  # [H]


def init_head(head: EagleHead, target_lm_head: torch.Tensor, draft_ids: torch.Tensor,
              target_norm: torch.Tensor, seed: int = 0,
              target_layer: LayerWeights | None = None) -> None:
    """A fresh head: small random projections (fc near the identity on the last aux layer), unit
    norms, the final norm and the LM head rows of the draft vocabulary copied from the target
    (the head starts from the target's reading of a late hidden state).

    ``target_layer``: the weights of a decoder layer of the target shaped like the head's,
    normally the one that reads the last aux state. The head's layer then starts as that layer
    over the hidden half of its input (the embedding half stays small and random): a trained
    layer's attention and MLP rather than noise (held-out acceptance +0.04-0.05 on the bundled
    model, docs/benchmarks.md)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (head.fc_weight, head.attn.qkv_weight, head.attn.o_weight,
                  head.mlp.gate_up_weight, head.mlp.down_weight):
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        head.attn.o_weight.mul_(0.1)
        head.mlp.down_weight.mul_(0.1)
        # fc starts near the last aux layer's stream, so the head's first output reads like the
        # target's own late hidden state (in scale and meaning) rather than noise
        H = head.eagle.hidden_size
        head.fc_weight.mul_(0.1)
        head.fc_weight[:, -H:] += torch.eye(H)
        for norm in (head.input_norm, head.hidden_norm, head.post_attn_norm):
            norm.weight.fill_(1.0)
        head.norm.weight.copy_(target_norm.float())
        head.lm_head_weight.copy_(target_lm_head[draft_ids].float())
        head.d2t.copy_(draft_ids - torch.arange(draft_ids.shape[0]))
        if target_layer is not None:
            H = head.eagle.hidden_size
            head.attn.qkv_weight[:, H:] = target_layer.qkv.float()
            for mine, theirs in ((head.attn.o_weight, target_layer.o),
                                 (head.mlp.gate_up_weight, target_layer.gate_up),
                                 (head.mlp.down_weight, target_layer.down),
                                 (head.hidden_norm.weight, target_layer.input_norm),
                                 (head.post_attn_norm.weight, target_layer.post_attn_norm)):
                mine.copy_(theirs.float())


def trainable_parameters(head: EagleHead) -> list[torch.nn.Parameter]:
    """Everything but the (shared, frozen) token embedding."""
    params = [head.fc_weight, head.attn.qkv_weight, head.attn.o_weight, head.mlp.gate_up_weight,
              head.mlp.down_weight, head.input_norm.weight, head.hidden_norm.weight,
              head.post_attn_norm.weight, head.norm.weight, head.lm_head_weight]
    return params + [p for p in (head.fc_bias,) if p is not None]


def ttt_loss(
    head: EagleHead,
    token_ids: torch.Tensor,  # [B, S] int64, padded
    aux: torch.Tensor,  # [B, S, D] the target's aux hidden states (D = fc input features)
    target_logits: torch.Tensor,  # [B, S, V_draft] target logits over the draft vocab (any float)
    lengths: torch.Tensor,  # [B] int64 valid tokens per row
    num_steps: int,
    response_start: torch.Tensor | None = None,  # [B] int64 first response token per row
) -> tuple[torch.Tensor, list[float], list[float]]:
    """The TTT loss of one batch; returns (weighted loss, per-step loss, per-step accuracy).

    With ``response_start``, only predictions of response tokens (position >= response_start)
    are trained and counted; the prompt is context only (every sequence repeats the chat
    template's system prompt, which would otherwise be a large, trivially learned share), and
    steps 1.. skip the leading positions whose predictions no step trains (the first
    ``min(response_start) - num_steps``: a visible share of a CPU step for chat prompts).
    Step 0 runs everywhere: its keys are the context of every later position."""
    B, S = token_ids.shape
    c = head.config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    emb = F.embedding(token_ids, head.embed_weight).float()  # [B, S, H]
    h = F.linear(aux.float(), head.fc_weight, head.fc_bias)  # [B, S, H]
    device = token_ids.device
    cos, sin = (t.to(device) for t in rope_tables(c, S + num_steps))
    positions = torch.arange(S, device=device)
    valid_tokens = positions[None, :] < lengths[:, None]  # [B, S] labels that are trained
    first = 0  # steps >= 1 run on positions first..S-1
    if response_start is not None:
        valid_tokens &= positions[None, :] >= response_start[:, None]
        first = max(0, min(int(response_start.min()), S) - num_steps)
    same = positions[:, None] == positions[None, :]
    causal = positions[:, None] >= positions[None, :]
    keys, values = [], []
    total = torch.zeros((), device=device)
    step_losses, step_accs = [], []
    for j in range(num_steps):
        shift = 1 + j  # step j at position t reads the token at t + 1 + j
        if shift >= S:
            break
        lo = 0 if j == 0 else first  # this step's positions: lo..S-1, n of them
        n = S - lo
        if j == 1:
            h = h[:, lo:]
        token_emb = F.pad(emb[:, lo + shift:], (0, 0, 0, shift))  # [B, n, H]
        valid = F.pad(valid_tokens[:, lo + shift:], (0, shift))  # [B, n] label at t + 1 + j
        x = torch.cat([_rms(head.input_norm, token_emb), _rms(head.hidden_norm, h)], dim=-1)
        qkv = F.linear(x, head.attn.qkv_weight)
        q = qkv[..., : hq * d].view(B, n, hq, d)
        k = qkv[..., hq * d: (hq + hkv) * d].view(B, n, hkv, d)
        v = qkv[..., (hq + hkv) * d:].view(B, n, hkv, d)
        rope_cos = cos[positions[lo:] + j][None, :, None]  # [1, n, 1, d]: RoPE position t + j
        rope_sin = sin[positions[lo:] + j][None, :, None]
        q, k = apply_rope(q, rope_cos, rope_sin), apply_rope(k, rope_cos, rope_sin)
        keys.append(k)
        values.append(v)
        # step 0's keys causally, each later step's key at the query's own position
        mask = torch.cat([causal[lo:]] + [same[lo:, lo:]] * j, dim=1)  # [n, S + n * j]
        out = _attention(q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                         torch.cat(values, 1).transpose(1, 2), mask, d ** -0.5)  # [B, hq, n, d]
        residual = h + F.linear(out.transpose(1, 2).reshape(B, n, hq * d), head.attn.o_weight)
        y = _rms(head.post_attn_norm, residual)
        gate, up = F.linear(y, head.mlp.gate_up_weight).chunk(2, dim=-1)
        out_hidden = residual + F.linear(F.silu(gate) * up, head.mlp.down_weight)
        # the LM head and the loss only where a label is trained (about half the work)
        rows, cols = valid.nonzero(as_tuple=True)
        labels = lo + cols + shift  # the label's position
        logits = F.linear(_rms(head.norm, out_hidden[rows, cols]), head.lm_head_weight)
        # against the target's distribution at position t + 1 + j
        loss, agree = soft_cross_entropy(logits, target_logits[rows, labels])
        num_valid = max(1, rows.shape[0])
        loss = loss / num_valid
        total = total + STEP_DECAY ** j * loss
        step_losses.append(float(loss.detach()))
        step_accs.append(float(agree) / num_valid)
        h = out_hidden
    return total, step_losses, step_accs


def dense(weight) -> torch.Tensor:
    """A target weight as a tensor: a GGUF weight kept quantised is dequantised (float32)."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.detach()


def copyable_layer(target, index: int, head: EagleHead) -> LayerWeights | None:
    """The weights of the target's decoder layer ``index`` if the head's layer can start as it
    (the same attention and MLP shapes; a hybrid target's SSM layer cannot), else None."""
    try:
        layer = target.layers[index]
        theirs = (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
                  layer.mlp.down_weight, layer.input_norm.weight, layer.post_attn_norm.weight)
    except (AttributeError, IndexError, TypeError):
        return None
    if not all(isinstance(t, (torch.Tensor, QuantizedWeight)) for t in theirs):
        return None
    theirs = LayerWeights(*(dense(t) for t in theirs))
    H = head.eagle.hidden_size
    mine = (head.attn.qkv_weight[:, H:], head.attn.o_weight, head.mlp.gate_up_weight,
            head.mlp.down_weight, head.hidden_norm.weight, head.post_attn_norm.weight)
    return theirs if all(t.shape == m.shape for t, m in zip(theirs, mine)) else None
