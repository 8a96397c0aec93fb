"""Model configuration: the fields of a Llama-family decoder, read from an HF ``config.json``.

One frozen dataclass covers Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and SmolLM; the differences
between them are flags (``qkv_bias``, ``o_bias``, ``qk_norm``, ``rope_scaling``,
``sliding_window``).
Both key spellings of transformers are read: ``rope_theta`` + ``rope_scaling`` (transformers 4)
and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str  # e.g. "LlamaForCausalLM": the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on the q, k, v projections (Qwen2: always)
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # Mistral: a key is visible iff query_pos - key_pos < window
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(
        cls,
        hf: dict[str, Any],
        architecture: str,
        *,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        uses_sliding_window: bool = False,
    ) -> ModelConfig:
        """Build from a parsed ``config.json``; the registry supplies the per-architecture flags.

        ``qkv_bias`` None reads ``attention_bias`` (which also sets ``o_bias``); True forces bias on
        q, k, v only (Qwen2). ``uses_sliding_window`` reads ``sliding_window`` (Mistral).
        """
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling = dict(hf.get("rope_scaling") or {})
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in {**rope_params, **rope_scaling}.items() if k != "rope_theta"}
        if hf.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window=True is not supported for {architecture}")
        sliding_window = hf.get("sliding_window") if uses_sliding_window else None
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if qkv_bias is None else False,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=sliding_window,
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory; a clear error when it is missing."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {model_dir!r} has no config.json")
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column "
                             f"{e.colno}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config
