"""A Mamba2 + attention hybrid in torch: HF ``GraniteMoeHybridForCausalLM`` in its dense
configurations (IBM Granite 4.0 H: granite-4.0-h-350m, granite-4.0-h-1b; ``num_local_experts=0``).

Each decoder layer is RMSNorm -> mixer (a Mamba2 layer or grouped-query attention) -> residual add
scaled by ``residual_multiplier`` -> RMSNorm -> SwiGLU MLP -> scaled residual add. The embedding
is scaled by ``embedding_multiplier``, attention scores by ``attention_multiplier`` (not
1/sqrt(head_dim)), the logits divided by ``logits_scaling``. Attention uses no positional
embedding (Granite 4.0 H: ``position_embedding_type`` "nope") unless the config says "rope".

The Mamba2 layer, its two forms (recurrent for decode and verify, chunked scan for long
prefills) and its per-slot state ring are in ``verispec.models.mamba2``; on the flat layout of
a GPU step (``forward_flat``, capturable in a CUDA graph) in ``verispec.models.mamba2_flat``;
its config, ``HybridModelConfig``, in ``verispec.models.config``.
"""

from __future__ import annotations

import dataclasses
import re
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.config import HybridModelConfig
from verispec.models.layers import MLP, RMSNorm, _param, input_norm_flat, set_cpu_matmuls
from verispec.models.layers import Attention as LlamaAttention
from verispec.models.layout import AttentionMetadata, FlatBatch
from verispec.models.mamba2 import HybridStep, Mamba2Mixer
from verispec.models.mamba2_flat import FlatMambaStep, mixer_forward_flat
from verispec.ops.cpu_linear import linear
from verispec.ops.model_ops import ModelOps


class HybridAttention(LlamaAttention):
    """Llama's grouped-query attention over the KV cache, scores scaled by
    ``attention_multiplier``."""

    def __init__(self, config: HybridModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.scale = config.attention_multiplier


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridModelConfig, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mamba = Mamba2Mixer(config, dtype) if layer_type == "mamba" else None
        self.attn = HybridAttention(config, dtype) if layer_type == "attention" else None
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, step: HybridStep | None,
                k_cache, v_cache) -> torch.Tensor:
        h = self.input_norm(x)
        if self.mamba is not None:
            h = self.mamba(h, step, k_cache)
        else:
            h = self.attn(h, meta, k_cache, v_cache)
        x = x + h * self.residual_multiplier
        return x + self.mlp(self.post_attn_norm(x)) * self.residual_multiplier

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier

    def forward_flat(self, x: torch.Tensor, residual: torch.Tensor | None, batch: FlatBatch,
                     step: FlatMambaStep | None, k_cache, v_cache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the flat layout (as ``DecoderLayer.forward_flat``: the residual adds
        fused into the norms). Takes the previous layer's scaled output x and the residual
        stream before it (None at layer 0: x is the embedding); returns this layer's scaled
        MLP output and the stream before it (the stream after the layer is their sum)."""
        ops = batch.ops
        h, residual = input_norm_flat(self.input_norm, x, residual, ops)
        if self.mamba is not None:
            h = mixer_forward_flat(self.mamba, h, batch, step, k_cache)
        else:
            h = self.attn.forward_flat(h, batch, k_cache, v_cache)
        h = ops.rms_norm(self._scaled(h), self.post_attn_norm.weight, self.post_attn_norm.eps,
                         residual)
        return self._scaled(self.mlp.forward_flat(h, ops)), residual


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_MAMBA_PARAM = re.compile(r"^model\.layers\.(\d+)\.(mamba\..+)$")
_HF_MODULES = {  # HF module inside a layer -> ours
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
    "shared_mlp.input_linear": "mlp.gate_up",
    "shared_mlp.output_linear": "mlp.down",
    "self_attn.o_proj": "attn.o",
    "mamba.in_proj": "mamba.in_proj",
    "mamba.conv1d": "mamba.conv",
    "mamba.out_proj": "mamba.out_proj",
}
_HF_MAMBA_PARAMS = {"mamba.dt_bias": "mamba.dt_bias", "mamba.A_log": "mamba.A_log",
                    "mamba.D": "mamba.D", "mamba.norm.weight": "mamba.norm_weight"}


class GraniteHybridForCausalLM(nn.Module):
    """The hybrid decoder plus LM head, with the runner-facing interface of
    ``LlamaForCausalLM``: ``forward`` returns final-norm hidden states, ``compute_logits`` the
    float32 logits of the rows asked for.

    ``k_caches[i]`` / ``v_caches[i]`` are layer i's K and V tensors for an attention layer and
    its ``MambaLayerState`` (both) for a Mamba2 layer (``verispec.runtime.state_cache``)."""

    def __init__(self, config: HybridModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None
        self.embed_weight = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, t, dtype)
                                    for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head_weight = (
            self.embed_weight if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dtype)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64 (padding columns hold any valid id)
        meta: AttentionMetadata,
        k_caches: list,  # per layer: K [num_blocks, block_size, hkv, d] | MambaLayerState
        v_caches: list,  # per layer: V [num_slots, max_model_len, hkv, d] | MambaLayerState
        num_layers: int | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the first ``num_layers`` layers (all by default; fewer = early exit: only those
        layers' KV rows and states are written), then the final norm. Returns [B, S, hidden];
        with ``capture_layers`` also the residual stream entering each listed layer."""
        B, S = input_ids.shape
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        step = None
        if any(layer.mamba is not None for layer in layers):
            step = HybridStep.from_metadata(meta, B, S)
        if not self.config.use_rope and any(layer.attn is not None for layer in layers):
            # No positional embedding: rotate by angle 0 (x * 1 + swapped * 0 == x exactly).
            meta = dataclasses.replace(meta, cos=torch.ones_like(meta.cos),
                                       sin=torch.zeros_like(meta.sin))
        x = F.embedding(input_ids, self.embed_weight) * self.config.embedding_multiplier
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, k_cache, v_cache) in enumerate(zip(layers, k_caches, v_caches)):
            if i in capture_layers:
                captured[i] = x
            x = layer(x, meta, step, k_cache, v_cache)
        if not capture_layers:
            return self.norm(x)
        return self.norm(x), [captured[i] for i in capture_layers]

    def forward_flat(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: FlatBatch,
        k_caches: list,  # per layer: K [num_blocks, block_size, hkv, d] | MambaLayerState
        v_caches: list,  # per layer: V [num_slots + 1, rows, hkv, d] | MambaLayerState
        num_layers: int | None = None,
        capture_layers: tuple[int, ...] = (),
        counts: torch.Tensor | None = None,  # [B] int64 real new tokens of a fixed-shape step
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` on the flat layout of a GPU step (``LlamaForCausalLM.forward_flat``; no
        host work per layer, capturable in a CUDA graph). ``counts``: in a step where every
        request is laid out as ``batch.max_queries`` tokens, how many are real (the rest pad;
        they leave the recurrent states alone); None: every laid-out token is real. Returns
        [T, hidden] after the final norm; with ``capture_layers`` also the residual stream
        entering those layers."""
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        step = None
        mamba_states = [k for layer, k in zip(layers, k_caches) if layer.mamba is not None]
        if mamba_states:
            step = FlatMambaStep.build(batch, input_ids.shape[0], counts, mamba_states[0])
        if not self.config.use_rope and any(layer.attn is not None for layer in layers):
            # No positional embedding: rotate by angle 0 (x * 1 + swapped * 0 == x exactly).
            batch = dataclasses.replace(batch, **self._identity_rope(batch.cos))
        x = F.embedding(input_ids, self.embed_weight) * self.config.embedding_multiplier
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, k_cache, v_cache) in enumerate(zip(layers, k_caches, v_caches)):
            if i in capture_layers:  # the stream entering layer i: x plus the residual before it
                captured[i] = x.clone() if residual is None else x + residual
            x, residual = layer.forward_flat(x, residual, batch, step, k_cache, v_cache)
        if residual is None:  # no layer ran
            out = batch.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        else:
            out = batch.ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)
        if not capture_layers:
            return out
        return out, [captured[i] for i in capture_layers]

    def _identity_rope(self, cos: torch.Tensor) -> dict[str, torch.Tensor]:
        """cos = 1 and sin = 0 tables shaped as the runner's, made once per shape and kept (a
        captured step reads the tensors of its warm-up run; runners of other lengths over the
        same model get their own)."""
        if not hasattr(self, "_identity_tables"):
            self._identity_tables: dict[tuple, dict[str, torch.Tensor]] = {}
        key = (tuple(cos.shape), cos.dtype, cos.device)
        if key not in self._identity_tables:
            self._identity_tables[key] = {"cos": torch.ones_like(cos),
                                          "sin": torch.zeros_like(cos)}
        return self._identity_tables[key]

    def compute_logits(self, hidden: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
        """[..., hidden] -> [..., vocab_size] float32 logits, divided by ``logits_scaling``
        (through ``ops.linear`` on the flat layout)."""
        if ops is not None:
            logits = ops.linear(hidden, self.lm_head_weight, out_dtype=torch.float32)
            return logits if self.config.logits_scaling == 1.0 else logits.div_(
                self.config.logits_scaling)
        logits = linear(hidden, self.lm_head_weight, None, self.matmul_splits, self.upcast_rows,
                        self.batch_invariant, self.kernels)
        # In place: the product is a new tensor, and a second [rows, vocab_size] one would cost a
        # fresh allocation (page faults) per step.
        return logits.float().div_(self.config.logits_scaling)

    def set_cpu_matmuls(self, splits: int, upcast_rows: int = 0, batch_invariant: bool = False,
                        kernels: ModuleType | None = None) -> None:
        """``models.layers.set_cpu_matmuls`` of every module."""
        set_cpu_matmuls(self, splits, upcast_rows, batch_invariant, kernels)

    def weight_target(self, name: str) -> tuple[str, slice | None] | None:
        """Our parameter and its rows for HF checkpoint tensor ``name`` (None: not ours)."""
        if name == "model.embed_tokens.weight":
            return "embed_weight", None
        if name == "model.norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else ("lm_head_weight", None)
        m = _HF_MAMBA_PARAM.match(name)
        if m and m.group(2) in _HF_MAMBA_PARAMS:
            return f"layers.{m.group(1)}.{_HF_MAMBA_PARAMS[m.group(2)]}", None
        m = _HF_LAYER.match(name)
        if not m:
            return None
        layer, module, kind = m.groups()
        prefix = f"layers.{layer}."
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            q, kv = self.config.q_size, self.config.kv_size
            bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[module[-6]]
            return f"{prefix}attn.qkv_{kind}", slice(*bounds)
        ours = _HF_MODULES.get(module)
        if ours is None:
            return None
        if ours.endswith("norm"):
            return f"{prefix}{ours}.{kind}", None
        return f"{prefix}{ours}_{kind}", None
