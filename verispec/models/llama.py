"""A Llama-family decoder in torch: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM.

Decoder layers of the blocks in ``models.layers`` (RMSNorm, RoPE, grouped-query attention over a
paged KV cache, SwiGLU MLP), then a tied or untied LM head. Written for a batch of requests that
each append a different number of new tokens (prefill, decode, or the n_r + 1 positions of a
speculative verify step) in one forward, on either step layout (``models.layout``): the padded
``[B, S]`` batch of ``forward`` or the flat tokens of ``forward_flat``.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from verispec.models.config import ModelConfig
from verispec.models.layers import MLP, Attention, RMSNorm, _param, input_norm_flat, set_cpu_matmuls
from verispec.models.layout import AttentionMetadata, FlatBatch
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.ops import quant
from verispec.ops.cpu_decoder import DecoderWeights, QuantDecoder
from verispec.ops.cpu_linear import linear
from verispec.ops.model_ops import ModelOps


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, dtype, tp)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, tp)

    def forward(self, x, meta, k_cache, v_cache):
        # x is this forward's own residual stream (the embedding output, then this layer's
        # sums), so the residual adds may run in place.
        x.add_(self.attn(self.input_norm(x), meta, k_cache, v_cache))
        return x.add_(self.mlp(self.post_attn_norm(x)))

    def forward_flat(self, x: torch.Tensor, residual: torch.Tensor | None, batch: FlatBatch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, partial: bool = False,
                     defer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the flat layout, the residual adds fused into the norms: takes the
        previous layer's output x and the residual stream before it (None at layer 0: x is the
        embedding), returns this layer's output and the stream before it.

        Under tensor parallelism (``TensorParallel.defers_reduction``): with ``partial`` x is
        the previous layer's partial sums, all-reduced inside this layer's input norm; with
        ``defer`` this layer's projections leave partial sums the same way (its output too)."""
        ops, tp = batch.ops, self.tp
        if partial:
            h = tp.reduce_rms_norm(x, self.input_norm.weight, self.input_norm.eps, residual)
        else:
            h, residual = input_norm_flat(self.input_norm, x, residual, ops)
        attn = self.attn.forward_flat(h, batch, k_cache, v_cache, reduce=not defer)
        norm = tp.reduce_rms_norm if defer else ops.rms_norm
        h = norm(attn, self.post_attn_norm.weight, self.post_attn_norm.eps, residual)
        return self.mlp.forward_flat(h, ops, reduce=not defer), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. ``forward`` returns final-norm hidden states; ``compute_logits``
    applies the LM head to the rows the caller needs (usually one per request, or the n_r + 1
    rows of a verify step), so the [*, vocab] matmul never runs on rows nobody reads.

    Under tensor parallelism (``tp``, ``models.parallel``) ``config`` is the rank's slice (its
    heads and FFN width; what the runner sizes the KV cache by), ``full_config`` the model's,
    and the embedding and LM head hold the rank's vocabulary rows."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.full_config = config
        self.tp = tp
        self.config = config = tp.shard_config(config)
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None
        # the layers as one compiled call on the CPU (GGUF weights kept quantised; see
        # set_cpu_matmuls); None: the per-op path
        self.quant_decoder: QuantDecoder | None = None
        vocab_rows = tp.vocab_shard_size(config.vocab_size)
        self.embed_weight = _param(vocab_rows, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head_weight = (
            self.embed_weight if config.tie_word_embeddings
            else _param(vocab_rows, config.hidden_size, dtype=dtype)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., hidden] (vocabulary-parallel under tensor parallelism)."""
        if self.tp.enabled:
            return self.tp.embedding(input_ids, self.embed_weight, self.config.vocab_size)
        return quant.embedding(input_ids, self.embed_weight)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64 (padding rows/columns hold any valid id)
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, hkv, head_dim]
        v_caches: list[torch.Tensor],
        num_layers: int | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the first ``num_layers`` layers (all by default; fewer = early exit), then the
        final norm. Returns [B, S, hidden] in the model dtype; with ``capture_layers`` also the
        residual stream entering each of those layers (HF's ``hidden_states[i]``; an EAGLE
        head's input), each [B, S, hidden], in the order given."""
        x = self.embed(input_ids)
        captured: dict[int, torch.Tensor] = {}
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        decoder = self.quant_decoder
        if decoder is not None and decoder.accepts(x, k_caches, v_caches):
            # one compiled call; it copies the stream entering each captured layer
            step, keep = decoder.step(x, meta, k_caches[0].shape[1])
            captured = {i: torch.empty_like(x) for i in capture_layers if i < len(layers)}
            decoder.run(x, step, k_caches, v_caches, 0, len(layers), captured)
            del keep
        else:
            for i, (layer, k_cache, v_cache) in enumerate(zip(layers, k_caches, v_caches)):
                if i in capture_layers:
                    captured[i] = x.clone()  # the layer adds into x in place
                x = layer(x, meta, k_cache, v_cache)
        if not capture_layers:
            return self.norm(x)
        return self.norm(x), [captured[i] for i in capture_layers]

    def forward_flat(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: FlatBatch,
        k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, hkv, head_dim]
        v_caches: list[torch.Tensor],
        num_layers: int | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` on the flat layout of a GPU step (one kernel per small op, no host
        work per layer, capturable in a CUDA graph). Returns [T, hidden] after the final norm;
        with ``capture_layers`` also the residual stream entering those layers, as ``forward``."""
        x = self.embed(input_ids)
        residual = None
        captured: dict[int, torch.Tensor] = {}
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        defer = self.tp.defers_reduction(x)
        pending = False  # x holds partial sums (``DecoderLayer.forward_flat``)
        for i, (layer, k_cache, v_cache) in enumerate(zip(layers, k_caches, v_caches)):
            if i in capture_layers:  # the stream entering layer i: x plus the residual before it
                if pending:
                    x, pending = self.tp.all_reduce(x), False
                captured[i] = x.clone() if residual is None else x + residual
            x, residual = layer.forward_flat(x, residual, batch, k_cache, v_cache, pending,
                                             defer)
            pending = defer
        if residual is None:  # no layer ran
            out = batch.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        elif pending:
            out = self.tp.reduce_rms_norm(x, self.norm.weight, self.norm.eps, residual)
        else:
            out = batch.ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)
        if not capture_layers:
            return out
        return out, [captured[i] for i in capture_layers]

    def compute_logits(self, hidden: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
        """[..., hidden] -> [..., vocab_size] float32 logits (through ``ops.linear`` on the GPU
        path); under tensor parallelism each rank's vocabulary slice, gathered."""
        if ops is not None:
            logits = ops.linear(hidden, self.lm_head_weight, out_dtype=torch.float32)
        else:
            logits = linear(hidden, self.lm_head_weight, None, self.matmul_splits,
                            self.upcast_rows, self.batch_invariant, self.kernels).float()
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def set_cpu_matmuls(self, splits: int, upcast_rows: int = 0, batch_invariant: bool = False,
                        kernels: ModuleType | None = None) -> None:
        """``models.layers.set_cpu_matmuls`` of every module (its docstring), and the compiled
        decoder (``ops.cpu_decoder``) where the kernels run every layer: GGUF weights kept
        quantised, one device, Llama's layers without Qwen3's q/k norms. It is batch invariant
        whatever ``batch_invariant`` says, and the model then runs every forward through it."""
        set_cpu_matmuls(self, splits, upcast_rows, batch_invariant, kernels)
        self.quant_decoder = None
        if (self.tp.enabled or not self.layers
                or any(type(layer) is not DecoderLayer or layer.attn.q_norm is not None
                       for layer in self.layers)):
            return
        c, attn = self.config, self.layers[0].attn
        self.quant_decoder = QuantDecoder.of(
            kernels,
            [DecoderWeights(layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
                            layer.mlp.down_weight, layer.input_norm.weight,
                            layer.post_attn_norm.weight, layer.attn.qkv_bias, layer.attn.o_bias,
                            layer.mlp.gate_up_bias, layer.mlp.down_bias)
             for layer in self.layers],
            c.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, c.intermediate_size,
            self.layers[0].input_norm.eps, attn.scale)
