"""Loading a model: a local HF directory (config.json + single or sharded safetensors), a GGUF
file, or, with no model given, the bundled SmolLM2-135M-Instruct GGUF.

A GGUF file is converted once into an HF-format directory in the user cache (see
``verispec.models.gguf``), so every model is finally loaded by the same safetensors path.
"""

from __future__ import annotations

import functools
import glob
import importlib
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from verispec.models import fast_tokenizer, gguf
from verispec.models.config import ModelConfig, read_hf_config
from verispec.models.gguf_quant import load_quantized
from verispec.models.llama import LlamaForCausalLM
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.models.registry import resolve_architecture
from verispec.ops.backend import get_backend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOAD_FORMATS = ("auto", "dummy")  # vLLM's load_format values that apply here
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


def iter_safetensors(model_dir: str, select: Callable[[str], Any] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, tensor) of every tensor in the directory's safetensors files; a truncated or
    garbage file is a ValueError naming it and what is wrong. ``select(name)``, when given,
    says what to read of each: None the whole tensor, an index (a tuple of slices) only those
    rows / columns (read as such from the file), ``SKIP`` nothing (the tensor is None)."""
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    index = None if select is None else select(name)
                    if index is SKIP:
                        yield name, None
                    elif index is None:
                        yield name, f.get_tensor(name)
                    else:
                        yield name, f.get_slice(name)[index]
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be "
                             "truncated or corrupt") from None


SKIP = "skip"  # iter_safetensors: a tensor this rank does not read

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


def tensor_parallel_slice(config: ModelConfig, tp: TensorParallel, name: str) -> Any:
    """What rank ``tp.rank`` reads of HF tensor ``name`` (``iter_safetensors``'s ``select``;
    ``config`` is the whole model's): its rows of a column-parallel matrix (q/k/v, gate/up, the
    embedding and LM head), its columns of a row-parallel one (o, down), ``SKIP`` for a
    row-parallel bias on ranks other than 0 (the bias is added once, after the sum), None
    (everything) for the norms."""
    if not tp.enabled:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, end = tp.vocab_range(config.vocab_size)
        return (slice(start, min(end, config.vocab_size)),)
    m = _LAYER.match(name)
    if not m:
        return None
    module, _, kind = m.group(2).rpartition(".")
    d, n = config.head_dim, tp.size
    heads = config.num_attention_heads // n
    kv_heads = max(1, config.num_key_value_heads // n)
    ffn = config.intermediate_size // n
    if module == "self_attn.q_proj":
        return (slice(tp.rank * heads * d, (tp.rank + 1) * heads * d),)
    if module in ("self_attn.k_proj", "self_attn.v_proj"):
        start = tp.kv_head_start(config)
        return (slice(start * d, (start + kv_heads) * d),)
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return (slice(tp.rank * ffn, (tp.rank + 1) * ffn),)
    if module in ("self_attn.o_proj", "mlp.down_proj"):
        if kind == "bias":
            return None if tp.rank == 0 else SKIP
        width = heads * d if module == "self_attn.o_proj" else ffn
        return (slice(None), slice(tp.rank * width, (tp.rank + 1) * width))
    return None


@torch.inference_mode()
def load_weights(model, config: ModelConfig,
                 tensors: Iterator[tuple[str, torch.Tensor | None]]) -> None:
    """Copy HF-named tensors into the (fused) parameters; every parameter row must be filled.
    ``config`` is the model's own (under tensor parallelism the rank's slice); a tensor given
    as None (``SKIP``) zero-fills its place; vocabulary rows past the vocabulary (the last
    rank's padding) are zero."""
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}
    vocab_rows = {"embed_weight", "lm_head_weight"}
    for pname in vocab_rows & set(params):
        pad = params[pname][config.vocab_size - getattr(model, "tp", SINGLE).vocab_range(
            config.vocab_size)[0]:]
        pad.zero_()
        filled[pname] += pad.numel()
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
        if pname in vocab_rows and tensor is not None:
            dest = dest[: tensor.shape[0]]  # the last rank's shard may pass the vocabulary
        if tensor is None:  # SKIP: a row-parallel bias that another rank adds
            dest.zero_()
            filled[pname] += dest.numel()
            continue
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


# tokenizer_config.json's class -> (module, name) of the transformers classes that a GGUF's cached
# directory may name (models.gguf._write_tokenizer)
_CACHED_TOKENIZER_CLASSES = {
    "TokenizersBackend": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "PreTrainedTokenizerFast": ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast"),
}


def _load_tokenizer(model_dir: str):
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    if gguf.cached_tokenizer_class(model_dir) in _CACHED_TOKENIZER_CLASSES:
        # a GGUF's cached directory: without transformers where that was checked to agree
        fast = fast_tokenizer.load(model_dir, _load_hf_tokenizer)
        if fast is not None:
            return fast
        tokenizer = _load_hf_tokenizer(model_dir)
        if not os.path.isfile(os.path.join(model_dir, fast_tokenizer.VERDICT_FILE)):
            fast_tokenizer.verify(model_dir, tokenizer)  # once: the next start may skip it
        return tokenizer
    return _load_hf_tokenizer(model_dir)


def _load_hf_tokenizer(model_dir: str):
    cached = _CACHED_TOKENIZER_CLASSES.get(gguf.cached_tokenizer_class(model_dir))
    if cached is not None:
        # AutoTokenizer chose this class when it wrote the directory; naming it skips
        # AutoTokenizer's config and model-class lookup, which imports transformers' model
        # machinery: ~1 s and ~55 MB of a GGUF's start (docs/benchmarks.md)
        return getattr(importlib.import_module(cached[0]), cached[1]).from_pretrained(model_dir)
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


def check_tensor_parallel(model: str | None, size: int) -> None:
    """ValueError naming the field unless ``model`` can be split over ``size`` ranks."""
    arch, config = resolve_architecture(read_hf_config(resolve_model_path(model)))
    if arch.model_cls is not LlamaForCausalLM:
        raise ValueError(f"tensor_parallel_size={size}: tensor parallelism runs Llama-family "
                         f"models; {arch.name} runs on one device")
    TensorParallel(0, size).check(config)


def quantized_gguf(model: str | None, dtype: str | torch.dtype | None,
                   device: str | torch.device, tp: TensorParallel = SINGLE) -> str | None:
    """The GGUF file to load with its weights kept quantised (``models.gguf_quant``), or None:
    with ``dtype`` None (the default), a GGUF (the bundled one when ``model`` is None) on a CPU
    that runs the quantised kernel. An explicit dtype dequantises."""
    if dtype is not None or torch.device(device).type != "cpu" or tp.enabled:
        return None
    if model is None:
        path = gguf.bundled_gguf_path()
    elif isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".gguf") \
            and os.path.isfile(model):
        path = os.fspath(model)
    else:
        return None
    return path if get_backend(device).quant_kernels() is not None else None


def load_model(
    model: str | None = None,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
    load_format: str = "auto",
) -> LoadedModel:
    """Load weights, tokenizer and EOS ids. ``dtype`` None: a GGUF on the CPU keeps its
    quantised weights (float32 activations; ``quantized_gguf``), anything else loads in
    bfloat16. ``tp``: this rank's slice of a tensor-parallel model (it reads only its rows and
    columns of each tensor). ``load_format``: ``"auto"`` reads the weights, ``"dummy"`` makes
    random ones on the device from ``config.json`` alone (``dummy_weights``). Raises ValueError
    naming the cause on bad input."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    gguf_path = None if load_format == "dummy" else quantized_gguf(model, dtype, device, tp)
    tokenizer = None
    if gguf_path is not None:
        # the tokenizer (mostly importing transformers: Python) loads on a thread while the
        # weights are packed (numpy copies, which release the GIL)
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(_load_tokenizer, gguf.gguf_meta_dir(gguf_path))
            net, config, model_dir = load_quantized(gguf_path)
            tokenizer = tokenizer.result()
    else:
        torch_dtype = parse_dtype("bfloat16" if dtype is None else dtype)
        model_dir = resolve_model_path(model)
        arch, config = resolve_architecture(read_hf_config(model_dir))
        if tp.enabled:
            check_tensor_parallel(model, tp.size)
        with torch.device(device):
            net = (arch.model_cls(config, dtype=torch_dtype, tp=tp) if tp.enabled
                   else arch.model_cls(config, dtype=torch_dtype))
        if load_format == "dummy":
            dummy_weights(net, seed=0)
        else:
            own = net.config if tp.enabled else config
            load_weights(net, own, iter_safetensors(
                model_dir, None if not tp.enabled
                else functools.partial(tensor_parallel_slice, config, tp)))
        net.eval()
        tokenizer = _load_tokenizer(model_dir)
    return LoadedModel(net, config, tokenizer, _eos_token_ids(model_dir, config, tokenizer),
                       model_dir)


@torch.inference_mode()
def dummy_weights(net: torch.nn.Module, seed: int = 0) -> None:
    """Random weights made on the model's device (vLLM's ``load_format="dummy"``): norms 1,
    everything else uniform in [-0.02, 0.02), from a generator seeded by ``seed`` and the
    parameter's name (so every rank makes the same values for a replicated parameter). For
    benchmarks of shapes whose checkpoint would not be worth writing; the tokens mean nothing."""
    for name, param in net.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        generator = torch.Generator(param.device).manual_seed(seed + zlib.crc32(name.encode()))
        param.uniform_(-0.02, 0.02, generator=generator)
