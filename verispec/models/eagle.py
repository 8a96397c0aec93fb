"""EAGLE draft heads (docs/design.md §5): one decoder layer fed the target's own hidden states.

Two architectures, named as vLLM's ``speculative_config`` methods:

- ``eagle`` (EAGLE-1): ``x = fc([embed(t); h])`` (2H -> H) with h the target's final-norm hidden
  state, one Llama decoder layer without an input norm, and the *target's* LM head applied to the
  layer's output (no final norm). The output is also the next draft step's h.
- ``eagle3`` (EAGLE-3): ``h = fc([a_1; a_2; a_3])`` (3H -> H) over the residual streams entering
  three target layers (``aux_layer_ids``; HF's ``hidden_states[i]``), then one decoder layer whose
  attention input is ``[input_norm(embed(t)); hidden_norm(h)]`` (2H) with h as the residual; its
  output before the final norm is the next draft step's h (no fc then), after ``norm`` it goes to
  the head's own LM head over ``draft_vocab_size`` tokens. Draft id i is target id
  ``i + d2t[i]``; ``t2d`` marks the target ids that have a draft id.

Position p of the head pairs the hidden state of target position p with the token at p + 1, and
its output predicts the token at p + 2 (so the head's cache, like a draft model's, is indexed by
the target's positions).

Reading and writing a head's checkpoint (``load_eagle_head``, ``save_eagle_head``) is
``verispec.models.eagle_checkpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from verispec.models.config import ModelConfig
from verispec.models.layers import MLP, Attention, RMSNorm, _param, set_cpu_matmuls
from verispec.models.layout import AttentionMetadata, FlatBatch
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.ops import quant
from verispec.ops.cpu_linear import linear
from verispec.ops.model_ops import ModelOps

EAGLE_METHODS = ("eagle", "eagle3")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE1_ARCHITECTURE = "EagleLlamaForCausalLM"


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SpecForge's default EAGLE-3 layers: an early, a middle and a late one."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class EagleConfig:
    """What a head's ``config.json`` says, checked against its target."""

    method: str  # "eagle" | "eagle3"
    layer: ModelConfig  # the decoder layer's shape (num_hidden_layers = 1)
    vocab_size: int  # the target vocabulary the head's ids refer to
    draft_vocab_size: int  # eagle3: rows of its LM head; eagle: = vocab_size
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # eagle3: target layers read; eagle: (num_target_layers,)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def fc_in_features(self) -> int:
        if self.method == "eagle3":
            return len(self.aux_layer_ids) * self.target_hidden_size
        return 2 * self.hidden_size

    def to_hf_dict(self) -> dict:
        """``config.json`` as vLLM and SGLang read an EAGLE-3 (or EAGLE-1) head."""
        c = self.layer
        hf = {
            "architectures": [EAGLE3_ARCHITECTURE if self.method == "eagle3"
                              else EAGLE1_ARCHITECTURE],
            "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": dict(c.rope_scaling) or None,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": self.vocab_size, "tie_word_embeddings": False,
            "attention_bias": c.qkv_bias, "torch_dtype": "float32",
        }
        if self.method == "eagle3":
            hf["draft_vocab_size"] = self.draft_vocab_size
            hf["target_hidden_size"] = self.target_hidden_size
            hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return hf


def eagle_config_from_hf(hf: dict, method: str, target: ModelConfig, path: str) -> EagleConfig:
    """Parse a head's ``config.json`` and check that it fits ``target``: the same vocabulary,
    hidden states of the target's size, aux layers inside the target; a ValueError naming both
    sizes (or the value) otherwise."""
    if method not in EAGLE_METHODS:
        raise ValueError(f"EAGLE method must be one of {EAGLE_METHODS}, got {method!r}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] < 1:
            raise ValueError(f"EAGLE head {path!r}: config.json needs {key} (an integer >= 1), "
                             f"got {hf.get(key)!r}")
    layer = ModelConfig.from_hf_dict({**hf, "num_hidden_layers": 1}, "EagleHead")
    vocab_size = hf["vocab_size"]
    if vocab_size != target.vocab_size:
        raise ValueError(
            f"EAGLE head {path!r} has vocab_size={vocab_size}, but the target has "
            f"vocab_size={target.vocab_size}: a head must share the target's vocabulary")
    target_hidden_size = hf.get("target_hidden_size") or layer.hidden_size
    if target_hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE head {path!r} reads hidden states of size {target_hidden_size} "
            f"(target_hidden_size), but the target has hidden_size={target.hidden_size}")
    draft_vocab_size = vocab_size
    L = target.num_hidden_layers
    if method == "eagle3":
        draft_vocab_size = hf.get("draft_vocab_size") or vocab_size
        if not isinstance(draft_vocab_size, int) or not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"EAGLE head {path!r}: draft_vocab_size must be an integer in "
                             f"[1, vocab_size={vocab_size}], got {draft_vocab_size!r}")
        eagle_config = hf.get("eagle_config") or {}
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(default_aux_layer_ids(L) if ids is None else ids)
        if len(aux) == 0 or not all(isinstance(i, int) and 0 <= i < L for i in aux):
            raise ValueError(
                f"EAGLE head {path!r}: eagle_aux_hidden_state_layer_ids must be layers of the "
                f"target, in [0, {L}) (it has num_hidden_layers={L}), got {list(aux)!r}")
    else:
        aux = (L,)  # the target's final-norm output
    return EagleConfig(method, layer, vocab_size, draft_vocab_size, target_hidden_size, aux)


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head; the parameters follow ``EagleConfig``.

    ``embed_weight`` is the target's embedding unless the checkpoint has its own; the EAGLE-1
    LM head is the target's. ``config`` is the decoder layer's ``ModelConfig`` (what a
    ``ModelRunner`` needs for the head's KV cache and RoPE tables).
    """

    def __init__(self, eagle: EagleConfig, embed_weight: torch.Tensor,
                 target_lm_head: torch.Tensor | None = None, fc_bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE,
                 embed_is_target: bool = False) -> None:
        super().__init__()
        self.eagle = eagle
        # Under tensor parallelism the decoder layer is split as the target's (``config`` is
        # the rank's slice); fc, the norms and an LM head of its own are whole on every rank;
        # the target's embedding and LM head are the rank's vocabulary slices.
        self.tp = tp
        self.config = c = tp.shard_config(eagle.layer)
        H = eagle.hidden_size
        self.embed_weight = embed_weight  # [vocab_size, H], a tensor, possibly the target's
        self.embed_sharded = tp.enabled and embed_is_target
        self.fc_weight = _param(H, eagle.fc_in_features, dtype=dtype)
        self.fc_bias = _param(H, dtype=dtype) if fc_bias else None
        self.attn = Attention(c, dtype, tp)
        self.post_attn_norm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype, tp)
        self.is_eagle3 = eagle.method == "eagle3"
        # the target's LM head (EAGLE-1; an EAGLE-3 head over the whole vocabulary without one
        # of its own), or the head's own over its draft vocabulary
        self.shares_lm_head = target_lm_head is not None
        self.lm_head_sharded = tp.enabled and self.shares_lm_head
        if self.is_eagle3:
            # the attention reads [embedding; hidden]: 2H input features
            self.attn.qkv_weight = _param(c.q_size + 2 * c.kv_size, 2 * H, dtype=dtype)
            self.input_norm = RMSNorm(H, c.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(H, c.rms_norm_eps, dtype)
            self.norm = RMSNorm(H, c.rms_norm_eps, dtype)
            self.lm_head_weight = (target_lm_head if self.shares_lm_head
                                   else _param(eagle.draft_vocab_size, H, dtype=dtype))
            # draft id i -> target id i + d2t[i]
            self.register_buffer("d2t", torch.zeros(eagle.draft_vocab_size, dtype=torch.int64))
        else:
            if target_lm_head is None:
                raise ValueError("an EAGLE-1 head drafts through the target's LM head: give it")
            self.lm_head_weight = target_lm_head  # [vocab_size, H], the target's
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None

    def draft_to_target(self) -> torch.Tensor | None:
        """[draft_vocab_size] int64 target id of each draft id; None when they coincide (an
        EAGLE-1 head, or an EAGLE-3 head over the whole vocabulary with d2t = 0)."""
        if not self.is_eagle3 or (self.eagle.draft_vocab_size == self.eagle.vocab_size
                                  and not self.d2t.any()):
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        return linear(x, weight, bias, self.matmul_splits, self.upcast_rows, self.batch_invariant,
                      self.kernels)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64: the token at p + 1 of each head position p
        hidden: torch.Tensor,  # [B, S, D]: target hidden states (D = fc input) or the head's own
        from_target: bool,  # hidden is the target's (fc applies) or the head's previous output
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],  # [1] x [num_blocks, block_size, hkv, head_dim]
        v_caches: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden for the LM head [B, S, H], hidden for the next draft step [B, S, H])."""
        emb = self.embed(input_ids).to(self.fc_weight.dtype)
        hidden = hidden.to(self.fc_weight.dtype)
        if self.is_eagle3:
            if from_target:
                hidden = self._linear(hidden, self.fc_weight, self.fc_bias)
            x = torch.cat([self.input_norm(emb), self.hidden_norm(hidden)], dim=-1)
            residual = hidden + self.attn(x, meta, k_caches[0], v_caches[0])
        else:
            x = self._linear(torch.cat([emb, hidden], dim=-1), self.fc_weight, self.fc_bias)
            residual = x + self.attn(x, meta, k_caches[0], v_caches[0])
        out = residual + self.mlp(self.post_attn_norm(residual))
        return (self.norm(out) if self.is_eagle3 else out), out

    def forward_flat(
        self,
        input_ids: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, D]: target hidden states or the head's own (as forward)
        from_target: bool,
        batch: FlatBatch,
        k_caches: list[torch.Tensor],  # [1] x [num_blocks, block_size, hkv, head_dim]
        v_caches: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on the flat layout of a GPU step (``LlamaForCausalLM.forward_flat``: one
        kernel per small op, capturable), the residual adds fused into the norms. Returns
        ([T, H] for the LM head, [T, H] for the next draft step); ``hidden`` is left as it
        was."""
        ops = batch.ops
        emb = self.embed(input_ids).to(self.fc_weight.dtype)
        hidden = hidden.to(self.fc_weight.dtype)
        if self.is_eagle3:
            residual = (ops.linear(hidden, self.fc_weight, self.fc_bias) if from_target
                        else hidden.clone())  # the norms below add into it in place
            x = torch.cat([ops.rms_norm(emb, self.input_norm.weight, self.input_norm.eps),
                           ops.rms_norm(residual, self.hidden_norm.weight,
                                        self.hidden_norm.eps)], dim=-1)
        else:
            x = ops.linear(torch.cat([emb, hidden], dim=-1), self.fc_weight, self.fc_bias)
            residual = x  # read by the attention before the norm below adds into it
        attn = self.attn.forward_flat(x, batch, k_caches[0], v_caches[0])
        h = ops.rms_norm(attn, self.post_attn_norm.weight, self.post_attn_norm.eps, residual)
        mlp = self.mlp.forward_flat(h, ops)
        if self.is_eagle3:  # residual += mlp: the output, and its final norm for the LM head
            return ops.rms_norm(mlp, self.norm.weight, self.norm.eps, residual), residual
        out = residual + mlp
        return out, out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., H] (the target's embedding: vocabulary-parallel under TP)."""
        if self.embed_sharded:
            return self.tp.embedding(input_ids, self.embed_weight, self.eagle.vocab_size)
        return quant.embedding(input_ids, self.embed_weight)  # the target's may be quantised

    def compute_logits(self, hidden: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab_size] float32 (EAGLE-1: the target's vocabulary);
        through ``ops.linear`` on the GPU path; the target's LM head's slices gathered under
        tensor parallelism."""
        if ops is not None:
            logits = ops.linear(hidden, self.lm_head_weight, out_dtype=torch.float32)
        else:
            logits = self._linear(hidden, self.lm_head_weight).float()
        if self.lm_head_sharded:
            return self.tp.gather_vocab(logits, self.eagle.vocab_size)
        return logits

    def set_cpu_matmuls(self, splits: int, upcast_rows: int = 0, batch_invariant: bool = False,
                        kernels: ModuleType | None = None) -> None:
        """``models.layers.set_cpu_matmuls`` of every module."""
        set_cpu_matmuls(self, splits, upcast_rows, batch_invariant, kernels)
