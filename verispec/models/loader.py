"""Loading a model: a local HF directory (config.json + single or sharded safetensors), a GGUF
file, or, with no model given, the bundled SmolLM2-135M-Instruct GGUF.

A GGUF file is converted once into an HF-format directory in the user cache (see
``verispec.models.gguf``), so every model is finally loaded by the same safetensors path.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from verispec.models.config import ModelConfig, read_hf_config
from verispec.models.gguf_quant import load_quantized
from verispec.models.registry import resolve_architecture
from verispec.ops import cpu_kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class LoadedModel:
    model: torch.nn.Module  # LlamaForCausalLM, eval mode, on the device
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, None when the directory has none
    eos_token_ids: tuple[int, ...]
    path: str  # the HF directory the weights came from


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")


def resolve_model_path(model: str | None) -> str:
    """The HF directory to load for ``model`` (None = the bundled GGUF), converting GGUF files."""
    from verispec.models import gguf

    if model is None:
        return gguf.gguf_to_hf_dir(gguf.bundled_gguf_path())
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path to a directory or a .gguf file, got {model!r}")
    model = os.fspath(model)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return gguf.gguf_to_hf_dir(model)
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} is not a local directory or .gguf file (models are loaded from "
            "local files only)"
        )
    return model


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"model directory {model_dir!r} is missing shard(s) {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors weights")
    return files


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the directory's safetensors files; a truncated or
    garbage file is a ValueError naming it and what is wrong."""
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be "
                             "truncated or corrupt") from None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our parameter inside the layer, which part of a fused matrix)
_LAYER_PARAMS = {
    "self_attn.q_proj": ("attn.qkv", 0),
    "self_attn.k_proj": ("attn.qkv", 1),
    "self_attn.v_proj": ("attn.qkv", 2),
    "self_attn.o_proj": ("attn.o", None),
    "self_attn.q_norm": ("attn.q_norm", None),
    "self_attn.k_norm": ("attn.k_norm", None),
    "mlp.gate_proj": ("mlp.gate_up", 0),
    "mlp.up_proj": ("mlp.gate_up", 1),
    "mlp.down_proj": ("mlp.down", None),
    "input_layernorm": ("input_norm", None),
    "post_attention_layernorm": ("post_attn_norm", None),
}
_NORMS = ("attn.q_norm", "attn.k_norm", "input_norm", "post_attn_norm")


def _target(model, config: ModelConfig, name: str) -> tuple[str, slice | None] | None:
    """Our parameter name and the rows of it that HF tensor ``name`` fills; None = not ours."""
    if name == "model.embed_tokens.weight":
        return "embed_weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return None if config.tie_word_embeddings else ("lm_head_weight", None)
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    module, _, kind = rest.rpartition(".")  # kind: weight | bias
    if module not in _LAYER_PARAMS:
        return None
    ours, part = _LAYER_PARAMS[module]
    param = f"layers.{layer}.{ours}.{kind}" if ours in _NORMS else f"layers.{layer}.{ours}_{kind}"
    if part is None:
        return param, None
    if ours == "attn.qkv":
        q, kv = config.q_size, config.kv_size
        bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][part]
    else:
        size = config.intermediate_size
        bounds = (part * size, (part + 1) * size)
    return param, slice(*bounds)


@torch.inference_mode()
def load_weights(model, config: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the (fused) parameters; every parameter row must be filled."""
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}
    for name, tensor in tensors:
        # A model with its own checkpoint layout names its parameters (granite_hybrid).
        target = (model.weight_target(name) if hasattr(model, "weight_target")
                  else _target(model, config, name))
        if target is None:
            continue
        pname, rows = target
        if pname not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {config.architecture}")
        dest = params[pname] if rows is None else params[pname][rows]
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled[pname] += dest.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:8]}")


def _load_tokenizer(model_dir: str):
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: str, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def quantized_gguf(model: str | None, dtype: str | torch.dtype | None,
                   device: str | torch.device) -> str | None:
    """The GGUF file to load with its weights kept quantised (``models.gguf_quant``), or None:
    with ``dtype`` None (the default), a GGUF (the bundled one when ``model`` is None) on a CPU
    that runs the quantised kernel. An explicit dtype dequantises."""
    if dtype is not None or torch.device(device).type != "cpu":
        return None
    if model is None:
        from verispec.models import gguf

        path = gguf.bundled_gguf_path()
    elif isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".gguf") \
            and os.path.isfile(model):
        path = os.fspath(model)
    else:
        return None
    return path if cpu_kernels.quant_available() else None


def load_model(
    model: str | None = None,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load weights, tokenizer and EOS ids. ``dtype`` None: a GGUF on the CPU keeps its
    quantised weights (float32 activations; ``quantized_gguf``), anything else loads in
    bfloat16. Raises ValueError naming the cause on bad input."""
    gguf_path = quantized_gguf(model, dtype, device)
    if gguf_path is not None:
        net, config, model_dir = load_quantized(gguf_path)
    else:
        torch_dtype = parse_dtype("bfloat16" if dtype is None else dtype)
        model_dir = resolve_model_path(model)
        arch, config = resolve_architecture(read_hf_config(model_dir))
        with torch.device(device):
            net = arch.model_cls(config, dtype=torch_dtype)
        load_weights(net, config, iter_safetensors(model_dir))
        net.eval()
    tokenizer = _load_tokenizer(model_dir)
    return LoadedModel(net, config, tokenizer, _eos_token_ids(model_dir, config, tokenizer),
                       model_dir)
