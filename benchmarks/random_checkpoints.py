"""The models and speculative configurations ``bench_serving.py`` and ``bench_prefix.py`` share.

- ``target_checkpoint``: a random-weight Llama-3.1-8B-shaped target (``tiny``: a 2-layer one
  for CPU smoke runs), written once under a work directory by ``bench_gpu_e2e``'s builder.
- ``eagle3_head``: a random EAGLE-3 head shaped for any Llama-family target (the bundled model
  included), written once per target shape, also by ``bench_gpu_e2e``'s builder.
- ``speculative_config``: ``none``, ``ngram`` (k = 3), ``eagle3`` (k = 3, synthetic acceptance
  with mean acceptance length 2.5, so a random head drafts as a trained one would) or a vLLM
  ``speculative_config`` JSON object, as the dict ``LLM`` and ``verispec serve`` take.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_e2e  # noqa: E402

K = 3
ACCEPTANCE_LENGTH = 2.5
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
CONFIG_NAMES = ("none", "ngram", "eagle3")


def target_checkpoint(workdir: str, tiny: bool, device: str) -> str:
    """The random target's directory under ``workdir``, built unless already there."""
    path = os.path.join(workdir, "tiny-target" if tiny else "target")
    kwargs = bench_gpu_e2e.model_configs(tiny)["target"]
    os.makedirs(path, exist_ok=True)
    if not bench_gpu_e2e.has_checkpoint(path, kwargs):
        print(f"writing a random {'tiny' if tiny else '8B-shaped'} target into {path}",
              flush=True)
        bench_gpu_e2e.build_checkpoint(kwargs, path, torch.device(device), seed=0)
    return path


def model_config(model: str | None) -> dict:
    """The ``config.json`` of a model directory, a ``.gguf`` file or (None) the bundled model."""
    from verispec.models import gguf
    from verispec.models.config import read_hf_config

    if model is None:
        model = gguf.bundled_gguf_path()
    if model.endswith(".gguf"):
        model = gguf.gguf_meta_dir(model)
    return read_hf_config(model)


def eagle3_head(model: str | None, workdir: str, device: str) -> str:
    """A random EAGLE-3 head for ``model``'s shape under ``workdir`` (built unless there)."""
    config = model_config(model)
    target = dict(rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                  max_position_embeddings=8192)
    target.update({key: value for key, value in config.items() if value is not None})
    draft_vocab_size = min(bench_gpu_e2e.DRAFT_VOCAB, target["vocab_size"] // 2)
    shape = (target["hidden_size"], target["num_hidden_layers"], target["vocab_size"])
    path = os.path.join(workdir, "eagle3-{}x{}-v{}".format(*shape))
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        print(f"writing a random EAGLE-3 head into {path}", flush=True)
        bench_gpu_e2e.build_eagle_head(target, path, torch.device(device), 7, draft_vocab_size)
    return path


def speculative_config(name: str, model: str | None, workdir: str, device: str) -> dict | None:
    """The ``speculative_config`` dict a configuration name (or JSON object) stands for; None
    for no speculation."""
    if name == "none":
        return None
    if name == "ngram":
        return dict(NGRAM)
    if name == "eagle3":
        return {"method": "eagle3", "model": eagle3_head(model, workdir, device),
                "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_length": ACCEPTANCE_LENGTH}
    try:
        config = json.loads(name)
    except json.JSONDecodeError:
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"a configuration is one of {', '.join(CONFIG_NAMES)} or a JSON "
                         f"object, got {name!r}")
    return None if config.get("method") == "none" else config


def split_configs(text: str) -> list[str]:
    """``--configs`` as a list: names separated by commas, or one JSON object."""
    text = text.strip()
    return [text] if text.startswith("{") else [c.strip() for c in text.split(",") if c.strip()]


def config_label(name: str) -> str:
    """A short name for tables and plots (a JSON object by its method)."""
    if name in CONFIG_NAMES:
        return name
    try:
        return str(json.loads(name).get("method", "custom"))
    except (json.JSONDecodeError, AttributeError):
        return name[:20]
