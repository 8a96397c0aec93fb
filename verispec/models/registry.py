"""Architecture registry: the ``architectures`` entry of ``config.json`` picks the model class and
the per-architecture flags used to read its config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from verispec.models.config import HybridModelConfig, ModelConfig
from verispec.models.granite_hybrid import GraniteHybridForCausalLM
from verispec.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Architecture:
    name: str  # HF class name, e.g. "Qwen3ForCausalLM"
    model_cls: type[nn.Module]
    config_flags: dict[str, Any] = field(default_factory=dict)  # ModelConfig.from_hf_dict flags
    config_cls: type[ModelConfig] = ModelConfig  # its from_hf_dict reads config.json


_ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(name: str, model_cls: type[nn.Module],
                          config_cls: type[ModelConfig] = ModelConfig,
                          **config_flags: Any) -> None:
    _ARCHITECTURES[name] = Architecture(name, model_cls, dict(config_flags), config_cls)


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(hf_config: dict[str, Any]) -> tuple[Architecture, ModelConfig]:
    """The registered architecture of a parsed ``config.json`` and its ModelConfig.

    Raises ValueError listing the supported architectures when it is not registered.
    """
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            arch = _ARCHITECTURES[name]
            return arch, arch.config_cls.from_hf_dict(hf_config, name, **arch.config_flags)
    raise ValueError(
        f"unsupported architecture {names or hf_config.get('model_type')!r}; "
        f"supported: {supported_architectures()}"
    )


register_architecture("LlamaForCausalLM", LlamaForCausalLM)  # Llama 2/3.x, SmolLM
register_architecture("MistralForCausalLM", LlamaForCausalLM, uses_sliding_window=True)
register_architecture("Qwen2ForCausalLM", LlamaForCausalLM, qkv_bias=True)
register_architecture("Qwen3ForCausalLM", LlamaForCausalLM, qk_norm=True)
# Granite 4.0 H (Mamba2 + attention), dense configurations only
register_architecture("GraniteMoeHybridForCausalLM", GraniteHybridForCausalLM,
                      config_cls=HybridModelConfig)
