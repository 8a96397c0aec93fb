"""A GGUF Llama-family model loaded with its weights kept quantised (``verispec.ops.quant``).

No conversion step: the weights are read from the GGUF itself (memory-mapped by the ``gguf``
package) and packed once into the kernel's layout at every start; only the config and the
tokenizer are cached (``gguf.gguf_meta_dir``). Matrices of a type ``ops.quant`` keeps (Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) become ``QuantizedWeight`` modules in place of the parameters
(q|k|v and gate|up fused as the dense model fuses them); other tensors (norms, float matrices,
other quantisations) are dequantised to float32 parameters. Activations run in float32.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from verispec.models import gguf as gguf_files
from verispec.models.config import ModelConfig, read_hf_config
from verispec.models.registry import resolve_architecture
from verispec.ops.quant import QUANT_TYPES, QuantizedWeight, pack_gguf

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


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.ReaderTensor`` names its fields."""

    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost (input) dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # [rows, bytes per row] uint8 (float32 / float16 values for those types)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}


def read_tensors(gguf_path: str) -> tuple[dict[str, object], list[GGUFTensor]]:
    """(scalar and string metadata, the tensors memory-mapped) of a GGUF file. The gguf
    package's reader builds every metadata array element as a numpy view (the tokenizer's
    ~100 000 strings: ~7 s); this one skips arrays, so it takes milliseconds."""
    import gguf

    with open(gguf_path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic")
        _, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def value(kind: int):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                elem, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if elem in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[elem])
                else:
                    for _ in range(count):
                        value(elem)
                return None
            fmt = _SCALARS[kind]
            pos += struct.calcsize(fmt)
            return struct.unpack_from(fmt, buf, pos - struct.calcsize(fmt))[0]

        meta = {}
        for _ in range(num_kv):
            key = string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            meta[key] = value(kind)
        infos = []
        for _ in range(num_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
    except (ValueError, IndexError, KeyError, struct.error, UnicodeError) as e:
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "it may be truncated or corrupt") from None
    alignment = meta.get("general.alignment") or 32
    start = -(-pos // alignment) * alignment
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block_size * type_size
        raw = data[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        if qtype.name in ("F32", "F16"):
            raw = raw.view(np.float32 if qtype.name == "F32" else np.float16)
            if len(dims) == 1:
                raw = raw.reshape(-1)
        tensors.append(GGUFTensor(name, tuple(dims), qtype, raw))
    return meta, tensors


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
    meta, tensors = read_tensors(gguf_path)
    arch = meta.get("general.architecture")
    with torch.device("meta"):
        net = arch_entry.model_cls(config, dtype=torch.float32)
    hidden = config.hidden_size
    grouped: dict[tuple, dict[int, tuple[str, np.ndarray]]] = {}
    for t in tensors:
        name = t.name
        if name == "token_embd.weight":
            _set(net, "embed_weight", _matrix([_rows(t, arch, None)], hidden))
        elif name == "output.weight":
            _set(net, "lm_head_weight", _matrix([_rows(t, arch, None)], hidden))
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
                heads = {"attn_q": config.num_attention_heads,
                         "attn_k": config.num_key_value_heads}.get(kind)
                key = (int(layer), module, f"{fused}_{suffix}")
                grouped.setdefault(key, {})[part] = _rows(t, arch, heads)
    for (layer, module, attr), parts in grouped.items():
        target = net.layers[layer].get_submodule(module)
        ordered = [parts[i] for i in sorted(parts)]
        if attr.endswith("_bias"):
            bias = np.concatenate([data.reshape(-1) for _, data in ordered])
            _set(target, attr, nn.Parameter(torch.from_numpy(bias), requires_grad=False))
        else:
            _set(target, attr, _matrix(ordered, getattr(target, attr).shape[1]))
    if config.tie_word_embeddings:
        _set(net, "lm_head_weight", net.embed_weight)
    missing = [n for n, p in [*net.named_parameters(), *net.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"{gguf_path} is missing weights for {missing[:8]}")
    net.eval()
    return net, config, model_dir
