"""Model configuration: the fields of a Llama-family decoder, read from an HF ``config.json``.

One frozen dataclass covers Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and SmolLM; the differences
between them are flags (``qkv_bias``, ``o_bias``, ``qk_norm``, ``rope_scaling``,
``sliding_window``).
Both key spellings of transformers are read: ``rope_theta`` + ``rope_scaling`` (transformers 4)
and ``rope_parameters`` (transformers 5).
``HybridModelConfig`` adds the Mamba2 and Granite fields of the hybrid models: here, below both
the Mamba2 layer (``verispec.models.mamba2``) and the model (``verispec.models.granite_hybrid``)
that read it.
"""

from __future__ import annotations

import dataclasses
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


LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
               "full_attention": "attention"}  # HF spellings (transformers 4 and 5) -> ours
POSITION_EMBEDDING_TYPES = (None, "nope", "rope")


def _json_float(value: Any, field: str) -> float:
    """A float of config.json; transformers 5 writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} holds {value!r}, not a number") from None


@dataclass(frozen=True)
class HybridModelConfig(ModelConfig):
    """ModelConfig of a Llama-family decoder plus the Mamba2 and Granite fields.

    ``intermediate_size`` is the dense MLP's (HF ``shared_intermediate_size``).
    """

    layer_types: tuple[str, ...] = ()  # per layer: "mamba" | "attention"
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_rope: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(f"mamba_n_heads ({self.mamba_n_heads}) must be a multiple of "
                             f"mamba_n_groups ({self.mamba_n_groups})")
        for name in ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_d_conv",
                     "mamba_chunk_size"):
            if "mamba" in self.layer_types and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def mamba_conv_dim(self) -> int:  # channels of the conv: x, B and C
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mamba"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], architecture: str, **flags: Any
                     ) -> HybridModelConfig:
        """Read a GraniteMoeHybrid ``config.json``; MoE configurations are refused."""
        experts = hf.get("num_local_experts", 0) or 0
        if experts:
            raise ValueError(
                f"num_local_experts={experts}: only dense {architecture} configurations "
                "(num_local_experts=0, e.g. granite-4.0-h-350m, granite-4.0-h-1b) are supported")
        raw_types = hf.get("layer_types") or hf.get("layers_block_type")
        if not isinstance(raw_types, list):
            raise ValueError(f"{architecture} config needs layer_types (a list of 'mamba' / "
                             f"'attention' per layer), got {raw_types!r}")
        unknown = sorted({t for t in raw_types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise ValueError(f"layer_types holds {unknown!r}; supported: {sorted(LAYER_TYPES)}")
        position = hf.get("position_embedding_type")
        if position not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type {position!r} is not supported; "
                             f"supported: {POSITION_EMBEDDING_TYPES}")
        hidden = hf["hidden_size"]
        n_heads = hf.get("mamba_n_heads", 128)
        d_head = hf.get("mamba_d_head", "auto")
        expand = hf.get("mamba_expand", 2)
        if d_head == "auto":
            d_head = expand * hidden // n_heads
        if d_head * n_heads != expand * hidden:
            raise ValueError(f"mamba_d_head ({d_head}) * mamba_n_heads ({n_heads}) must equal "
                             f"mamba_expand ({expand}) * hidden_size ({hidden})")
        limit = [_json_float(v, "time_step_limit")
                 for v in (hf.get("time_step_limit") or (0.0, float("inf")))]
        if len(limit) != 2 or not 0.0 <= limit[0] <= limit[1]:
            raise ValueError(f"time_step_limit must be [min, max] with 0 <= min <= max, got "
                             f"{hf.get('time_step_limit')!r}")
        base = ModelConfig.from_hf_dict(
            {**hf, "intermediate_size": hf.get("shared_intermediate_size", 1024)}, architecture,
            **flags)
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)},
            layer_types=tuple(LAYER_TYPES[t] for t in raw_types),
            mamba_n_heads=n_heads,
            mamba_d_head=d_head,
            mamba_d_state=hf.get("mamba_d_state", 256),
            mamba_n_groups=hf.get("mamba_n_groups", 1),
            mamba_d_conv=hf.get("mamba_d_conv", 4),
            mamba_chunk_size=hf.get("mamba_chunk_size", 256),
            mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
            time_step_limit=(float(limit[0]), float(limit[1])),
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
            logits_scaling=float(hf.get("logits_scaling", 1.0)),
            use_rope=position == "rope",
        )
