"""A GGUF Llama-family model loaded with its weights kept quantised (``verispec.ops.quant``).

No conversion step: the weights are read from the GGUF itself (memory-mapped by the ``gguf``
package) and packed once into the kernel's layout at every start; only the config and the
tokenizer are cached (``gguf.gguf_meta_dir``). Matrices of a type ``ops.quant`` keeps (Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) become ``QuantizedWeight`` modules in place of the parameters
(q|k|v and gate|up fused as the dense model fuses them); other tensors (norms, float matrices,
other quantisations) are dequantised to float32 parameters. Activations run in float32.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
from torch import nn

from verispec.models import gguf as gguf_files
from verispec.models import gguf_file
from verispec.models.config import ModelConfig, read_hf_config
from verispec.models.registry import resolve_architecture
from verispec.ops.quant import QUANT_TYPES, QuantizedWeight, pack_gguf

logger = logging.getLogger("verispec")

# GGUF name inside a block -> (our module path inside a layer, attribute, fused part order)
_LAYER_TENSORS = {
    "attn_q": ("attn", "qkv", 0),
    "attn_k": ("attn", "qkv", 1),
    "attn_v": ("attn", "qkv", 2),
    "attn_output": ("attn", "o", 0),
    "ffn_gate": ("mlp", "gate_up", 0),
    "ffn_up": ("mlp", "gate_up", 1),
    "ffn_down": ("mlp", "down", 0),
}
_LAYER_NORMS = {
    "attn_norm": "input_norm",
    "ffn_norm": "post_attn_norm",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
}


def _dense(t) -> np.ndarray:
    """A GGUF tensor as float32 [*reversed(shape)] (the gguf package's dequantisation)."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape))
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def _rows(t, arch: str, heads: int | None) -> tuple[str, np.ndarray]:
    """(type name, data [out_features, ...]) with llama.cpp's q/k row interleave undone."""
    data = t.data.reshape(int(t.shape[-1]) if len(t.shape) > 1 else -1, -1)
    if t.tensor_type.name not in QUANT_TYPES:
        data = _dense(t).reshape(data.shape[0], -1)
    if heads is not None and arch in gguf_files._PERMUTED_QK:
        data = gguf_files._unpermute(data, heads)
    return t.tensor_type.name, data


def _matrix(parts: list[tuple[str, np.ndarray]], in_features: int
            ) -> QuantizedWeight | nn.Parameter:
    """The fused weight of ``parts`` (each [rows, ...]): quantised where every part is of a kept
    type, else float32."""
    if all(qtype in QUANT_TYPES for qtype, _ in parts):
        return pack_gguf(parts, in_features)
    dense = []
    for qtype, data in parts:
        if qtype in QUANT_TYPES:
            data = pack_gguf([(qtype, data)], in_features).dequantize().numpy()
        dense.append(data.reshape(-1, in_features))
    return nn.Parameter(torch.from_numpy(np.concatenate(dense)), requires_grad=False)


def _set(module: nn.Module, name: str, value: QuantizedWeight | nn.Parameter) -> None:
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, value)


def load_quantized(gguf_path: str) -> tuple[nn.Module, ModelConfig, str]:
    """(model on the CPU, eval mode, float32 activations; its config; the cached directory with
    config and tokenizer) of the GGUF at ``gguf_path``."""
    model_dir = gguf_files.gguf_meta_dir(gguf_path)
    arch_entry, config = resolve_architecture(read_hf_config(model_dir))
    meta, tensors = gguf_file.read_tensors(gguf_path)
    arch = meta.get("general.architecture")
    with torch.device("meta"):
        net = arch_entry.model_cls(config, dtype=torch.float32)
    hidden = config.hidden_size
    grouped: dict[tuple, dict[int, gguf_file.GGUFTensor]] = {}
    for t in tensors:
        name = t.name
        if name == "token_embd.weight":
            _set(net, "embed_weight", _matrix([_rows(t, arch, None)], hidden))
            t.release()
        elif name == "output.weight":
            _set(net, "lm_head_weight", _matrix([_rows(t, arch, None)], hidden))
            t.release()
        elif name == "output_norm.weight":
            net.norm.weight = nn.Parameter(torch.from_numpy(_dense(t)), requires_grad=False)
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            layer_module = net.layers[int(layer)]
            if kind in _LAYER_NORMS:
                norm = layer_module.get_submodule(_LAYER_NORMS[kind])
                norm.weight = nn.Parameter(torch.from_numpy(_dense(t)), requires_grad=False)
            elif kind in _LAYER_TENSORS:
                module, fused, part = _LAYER_TENSORS[kind]
                key = (int(layer), module, f"{fused}_{suffix}")
                grouped.setdefault(key, {})[part] = t
    for (layer, module, attr), parts in grouped.items():
        target = net.layers[layer].get_submodule(module)
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
        ordered = [_rows(parts[i], arch, heads.get(parts[i].name.split(".")[2]))
                   for i in sorted(parts)]
        if attr.endswith("_bias"):
            bias = np.concatenate([data.reshape(-1) for _, data in ordered])
            _set(target, attr, nn.Parameter(torch.from_numpy(bias), requires_grad=False))
        else:
            _set(target, attr, _matrix(ordered, getattr(target, attr).shape[1]))
        for t in parts.values():
            t.release()
    if config.tie_word_embeddings:
        _set(net, "lm_head_weight", net.embed_weight)
    missing = [n for n, p in [*net.named_parameters(), *net.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"{gguf_path} is missing weights for {missing[:8]}")
    kinds = Counter(m.qtype for m in dict.fromkeys(net.modules())
                    if isinstance(m, QuantizedWeight))
    logger.info("%s: weights kept quantised (%s matrices), float32 activations",
                gguf_path, ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    net.eval()
    return net, config, model_dir
