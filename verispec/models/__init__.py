"""Llama-family models and their loading (HF safetensors directories, GGUF files)."""

from verispec.models.config import ModelConfig
from verispec.models.layout import AttentionMetadata
from verispec.models.llama import LlamaForCausalLM
from verispec.models.loader import LoadedModel, load_model, parse_dtype
from verispec.models.registry import register_architecture, supported_architectures

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "load_model",
    "parse_dtype",
    "register_architecture",
    "supported_architectures",
]
