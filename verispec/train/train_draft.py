"""``verispec train-draft``: train an EAGLE-3 head for a target from the target's own generations.

1. **Data**: the engine generates a response to every prompt and keeps the hidden states its
   steps compute (``verispec.train.data``); the responses alternate between greedy and sampled
   at 0.7 (``temperature``). Kept in ``<output_dir>/data.pt``, so a resumed run does not
   generate again. The defaults (5500 of the 6400 built-in prompts x 96 tokens, 256 at once,
   three epochs) fit the whole run in under 30 minutes on a 2-core CPU for the bundled model
   (docs/benchmarks.md): more prompts raise held-out acceptance as much as more epochs.
   The hidden states are those entering layers ``aux_layer_ids`` (L // 2, between it and the
   last, the last).
2. **Draft vocabulary**: the ``draft_vocab_size`` most frequent tokens of the data (the target's
   EOS tokens always among them); ``d2t`` maps them onto the target vocabulary.
3. **Training** (where the target runs, ``device``; bfloat16 autocast on a GPU and where the
   CPU's bfloat16 matmul is fast, ``amp``):
   AdamW with a linear warm-up and cosine decay (torch's schedulers) over
   ``epochs`` passes of shuffled batches, the TTT loss of ``verispec.train.eagle3`` with
   ``ttt_steps`` unrolled draft steps on the response tokens (the prompt is context only); a
   progress bar shows loss and step-0 accuracy.
4. **Checkpoints**: every ``save_every`` optimizer steps and at the end, the head is written in
   the layout vLLM and SGLang load (``config.json`` + ``model.safetensors``; ``method="eagle3"``,
   ``model=<output_dir>``) and the training state to ``<output_dir>/trainer_state.pt``; the
   same command with the same ``output_dir`` resumes from it.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from verispec.bench.report import progress
from verispec.engine.llm import LLM
from verispec.models.config import ModelConfig, read_hf_config
from verispec.models.eagle import EAGLE3_ARCHITECTURE, EagleConfig, EagleHead
from verispec.models.eagle_checkpoint import save_eagle_head
from verispec.models.gguf import gguf_meta_dir
from verispec.models.loader import quantized_gguf, resolve_model_path
from verispec.ops.backend import get_backend
from verispec.ops.quant import QuantizedWeight
from verispec.train.data import (
    Sample,
    batches,
    builtin_prompts,
    collate,
    feature_rms,
    generate_samples,
    load_prompt_file,
    select_draft_vocab,
)
from verispec.train.eagle3 import (
    copyable_layer,
    dense,
    init_head,
    trainable_parameters,
    ttt_loss,
)

logger = logging.getLogger("verispec")
STATE_FILE = "trainer_state.pt"
BUILTIN_PROMPTS = 5500  # of the 6400: what fits the 30-minute CPU run (docs/benchmarks.md)
DATA_FILE = "data.pt"


@dataclass(frozen=True)
class TrainDraftConfig:
    """``verispec train-draft`` settings (one flag each)."""

    output_dir: str
    model: str | None = None  # the target (None: the bundled model)
    prompts: str | None = None  # JSONL file; None: the built-in set
    # the first N prompts (None: all of a prompts file, the first BUILTIN_PROMPTS built-in ones)
    num_prompts: int | None = None
    max_new_tokens: int = 96
    # of the generated responses, taken in turn over the prompts: half greedy, half sampled
    # (the head then drafts both kinds of text better than from either alone)
    temperature: tuple[float, ...] = (0.0, 0.7)
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    epochs: int = 3
    batch_size: int = 8  # sequences per optimizer step
    lr: float = 2e-3
    warmup_steps: int = 20
    max_seq_len: int = 512
    save_every: int = 100
    seed: int = 0
    # the target's, for generation and hidden states; None: the engine's default, so the head
    # learns the model it drafts for (a GGUF on the CPU keeps its quantised weights)
    dtype: str | None = None
    device: str = "cpu"
    max_num_seqs: int = 256  # generation batch
    amp: bool = True  # bfloat16 matmuls in training on a GPU and where the CPU has fast ones
    # the three target layers the head reads (None: ``aux_layer_ids`` of the target)
    aux_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "draft_vocab_size", "ttt_steps", "epochs", "batch_size",
                     "max_seq_len", "save_every", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_prompts is not None and (not isinstance(self.num_prompts, int)
                                             or self.num_prompts < 1):
            raise ValueError(f"num_prompts must be an integer >= 1, got {self.num_prompts!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise ValueError(f"lr must be a number in (0, 1), got {self.lr!r}")
        temperature = self.temperature
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            temperature = (float(temperature),)
        if not (isinstance(temperature, (tuple, list)) and temperature
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0
                        for t in temperature)):
            raise ValueError(f"temperature must be one or more numbers >= 0, got "
                             f"{self.temperature!r}")
        object.__setattr__(self, "temperature", tuple(float(t) for t in temperature))
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.aux_layers is not None:
            ids = self.aux_layers
            if not (isinstance(ids, (tuple, list)) and len(ids) == 3 and len(set(ids)) == 3
                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                            for i in ids)):
                raise ValueError(f"aux_layers must be three distinct layer indices >= 0, got "
                                 f"{ids!r}")
            object.__setattr__(self, "aux_layers", tuple(ids))
        if not isinstance(self.amp, bool):
            raise ValueError(f"amp must be True or False, got {self.amp!r}")
        if not self.output_dir:
            raise ValueError("output_dir must name a directory to write the head to")
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ValueError(f"output_dir {self.output_dir!r} exists and is not a directory")


def _head_config(target: ModelConfig, draft_vocab_size: int,
                 aux_layers: tuple[int, ...] | None = None) -> EagleConfig:
    """An EAGLE-3 head shaped like one of the target's layers, reading ``aux_layers`` (default
    ``aux_layer_ids``)."""
    L = target.num_hidden_layers
    hf = {"hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
          "num_attention_heads": target.num_attention_heads,
          "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
          "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
          "rope_scaling": dict(target.rope_scaling) or None,
          "max_position_embeddings": target.max_position_embeddings,
          "vocab_size": target.vocab_size, "num_hidden_layers": 1}
    layer = ModelConfig.from_hf_dict(hf, EAGLE3_ARCHITECTURE)
    return EagleConfig("eagle3", layer, target.vocab_size, draft_vocab_size,
                       target.hidden_size, aux_layers or aux_layer_ids(L))


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers a trained head reads (the residual streams entering them): the middle
    one, one halfway from it to the last, and the last, (15, 22, 29) of 30. vLLM's and
    SpecForge's default (2, L // 2, L - 3; a head's ``config.json`` names its own layers, so
    both load it) held out less on the bundled model: offline, 4500 prompts, two seeds, 40
    held-out prompts, walk length 1.771 against 1.741, expected length at temperature 0.7
    1.765 against 1.734 (benchmarks/bench_train_draft.py). For a target of 3 or 4 layers, its
    last three."""
    ids = (num_layers // 2, (num_layers // 2 + num_layers - 1) // 2, num_layers - 1)
    if len(set(ids)) < 3:
        ids = (num_layers - 3, num_layers - 2, num_layers - 1)
    return ids


def _load_or_generate(cfg: TrainDraftConfig, llm, aux_layers) -> list[Sample]:
    path = os.path.join(cfg.output_dir, DATA_FILE)
    if os.path.isfile(path):
        logger.info("train-draft: reusing the generated data in %s", path)
        data = torch.load(path, weights_only=False, map_location="cpu")
        recorded = tuple(data["aux_layers"]) if isinstance(data, dict) else None
        if recorded != tuple(aux_layers):
            raise ValueError(f"{path} holds the hidden states of layers {recorded} (None: written "
                             f"before they were recorded), this run reads layers "
                             f"{tuple(aux_layers)}; remove it or use another output_dir")
        return [Sample(*s) for s in data["samples"]]
    prompts = builtin_prompts(cfg.seed) if cfg.prompts is None else load_prompt_file(cfg.prompts)
    limit = cfg.num_prompts
    if limit is None and cfg.prompts is None:
        limit = BUILTIN_PROMPTS
    prompts = prompts[:limit]
    samples = generate_samples(llm, prompts, aux_layers, cfg.max_new_tokens, cfg.temperature,
                               cfg.seed, batch_size=cfg.max_num_seqs * 8)
    torch.save({"aux_layers": list(aux_layers),
                "samples": [(s.token_ids, s.aux, s.final, s.response_start) for s in samples]},
               path)
    return samples


def train_draft(cfg: TrainDraftConfig, log=print, llm=None) -> dict:
    """Generate data, train, write the head to ``cfg.output_dir``; returns a summary dict
    (steps, losses, accuracies per TTT step, seconds). ``llm``: an engine already loaded with
    the target (``cfg.model``, ``cfg.dtype`` and ``cfg.device`` are then its own)."""
    start_time = time.perf_counter()
    os.makedirs(cfg.output_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    own_engine = llm is None
    if own_engine:
        # The data needs the target's distribution, not batch-invariant bits: faster matmuls.
        # a GGUF whose weights stay quantised is loaded from the file itself (no conversion)
        gguf_path = quantized_gguf(cfg.model, cfg.dtype, cfg.device)
        model_dir = gguf_meta_dir(gguf_path) if gguf_path else resolve_model_path(cfg.model)
        llm = LLM(gguf_path or model_dir, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                  device=cfg.device, max_model_len=_data_model_len(cfg, model_dir),
                  batch_invariant=False)
    target = llm.loaded.model
    # what the head learns from: "quantised" (a GGUF's own blocks) or the weights' dtype
    target_weights = ("quantised" if any(isinstance(m, QuantizedWeight) for m in target.modules())
                      else str(target.embed_weight.dtype).removeprefix("torch."))
    if (llm.device.type == "cpu" and target.embed_weight.dtype == torch.bfloat16
            and get_backend(llm.device).torch_has_fast_bf16()):
        # torch's bfloat16 matmul is fast here: keep it for many rows instead of the runner's
        # float32 widening, which slows the generation of many sequences at once
        set_matmuls = getattr(target, "set_cpu_matmuls", None)
        if set_matmuls is not None:
            set_matmuls(torch.get_num_threads(), upcast_rows=0, batch_invariant=False)
    tc = llm.model_config
    if cfg.draft_vocab_size > tc.vocab_size:
        raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} exceeds the target's "
                         f"vocab_size={tc.vocab_size}")
    L = tc.num_hidden_layers
    aux_layers = cfg.aux_layers or aux_layer_ids(L)
    if min(aux_layers) < 0:
        raise ValueError(f"the target has num_hidden_layers={L}; an EAGLE-3 head reads three "
                         "of its layers, so it needs at least 3")
    if max(aux_layers) >= L:
        raise ValueError(f"aux_layers={aux_layers} must be layers of the target, 0..{L - 1} "
                         f"(num_hidden_layers={L})")
    # a sequence trains every unrolled step: at least ttt_steps + 2 tokens
    samples = [s for s in _load_or_generate(cfg, llm, aux_layers)
               if len(s.token_ids) >= cfg.ttt_steps + 2]
    if not samples:
        raise ValueError("no training sequences were generated")
    gen_seconds = time.perf_counter() - start_time
    num_tokens = sum(len(s.token_ids) for s in samples)
    log(f"train-draft: {len(samples)} sequences, {num_tokens} tokens from the {target_weights} "
        f"target ({gen_seconds:.0f} s to generate and record)")

    draft_ids = select_draft_vocab(samples, tc.vocab_size, cfg.draft_vocab_size,
                                   tuple(llm.eos_token_ids))
    device = llm.device  # the head trains where the target runs
    if own_engine:  # its KV cache (7.5 GB for the bundled model at 256 sequences) is not needed
        del llm
        gc.collect()
    eagle = _head_config(tc, cfg.draft_vocab_size, aux_layers)
    embed = dense(target.embed_weight).float()
    lm_head = dense(target.lm_head_weight)
    head = EagleHead(eagle, embed, dtype=torch.float32)
    init_head(head, lm_head, draft_ids, target.norm.weight.detach(),
              cfg.seed, copyable_layer(target, aux_layers[-1], head))
    # fc trains on standardised inputs, aux / s with s each feature's RMS, as W' = W * s (saved
    # as W = W' / s, so the head reads the raw states): the aux layers' streams differ ~7x in
    # scale and a few features ~100x, and this way one optimizer step moves every input
    # feature's contribution alike (held-out acceptance rose in `verispec bench --prompts free`)
    aux_scale = feature_rms(samples)
    with torch.no_grad():
        head.fc_weight.mul_(aux_scale)
    aux_scale = aux_scale.to(device)
    head.to(device)
    # bfloat16 autocast: float32 weights, gradients and optimizer, the matmuls in bfloat16
    # (where torch has a fast bfloat16 matmul, a step is much faster); on a CPU without one, in
    # float32 (there autocast would be slower).
    amp = cfg.amp and get_backend(device).torch_has_fast_bf16()
    draft_head = lm_head[draft_ids.to(device)].to(  # [V_draft, H]
        torch.bfloat16 if amp else torch.float32)
    params = trainable_parameters(head)
    for p in params:
        p.requires_grad_(True)
    steps_per_epoch = math.ceil(len(samples) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    # fused: one kernel for every parameter instead of a loop of small ops per tensor
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=True)
    warmup = max(1, min(cfg.warmup_steps, total_steps // 4))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps))))))
    step, history = 0, []
    state_path = os.path.join(cfg.output_dir, STATE_FILE)
    if os.path.isfile(state_path):
        state = torch.load(state_path, weights_only=False, map_location="cpu")
        if state["config"] != _resumable(cfg) or not torch.equal(state["draft_ids"], draft_ids):
            raise ValueError(f"{state_path} was written by a run with other settings "
                             f"{state['config']}; use another output_dir or the same flags")
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history = state["step"], state["history"]
        log(f"train-draft: resuming at step {step} of {total_steps}")

    def save() -> None:
        with torch.no_grad():  # the checkpoint's fc reads the raw aux states: W' / s
            trained_fc = head.fc_weight.clone()
            head.fc_weight.div_(aux_scale)
            save_eagle_head(head, cfg.output_dir)
            head.fc_weight.copy_(trained_fc)
        torch.save({"config": _resumable(cfg), "draft_ids": draft_ids,
                    "params": [p.detach().clone() for p in params],
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "step": step, "history": history},
                   state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    bar = progress(total=total_steps, desc="train-draft", unit="step", disable=None)
    bar.update(step)
    epoch_batches: list[list[int]] = []
    epoch = step // steps_per_epoch
    if step < total_steps:  # the batches of an epoch are a function of (seed, epoch)
        epoch_batches = batches(samples, cfg.batch_size,
                                 random.Random(cfg.seed + epoch))[step % steps_per_epoch:]
    while step < total_steps:
        if not epoch_batches:
            epoch += 1
            epoch_batches = batches(samples, cfg.batch_size, random.Random(cfg.seed + epoch))
        batch = [samples[i] for i in epoch_batches.pop(0)]
        tokens, aux, target_logits, lengths, starts = collate(batch, cfg.max_seq_len, draft_head,
                                                               aux_scale)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss, losses, accs = ttt_loss(head, tokens, aux, target_logits, lengths,
                                          cfg.ttt_steps, starts)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        history.append({"step": step, "loss": losses, "acc": accs})
        bar.set_postfix(loss=f"{losses[0]:.3f}", acc=f"{accs[0]:.3f}",
                        acc_last=f"{accs[-1]:.3f}")
        bar.update(1)
        if step % cfg.save_every == 0 or step == total_steps:
            save()
    bar.close()
    if not os.path.isfile(os.path.join(cfg.output_dir, "model.safetensors")):
        save()
    recent = history[-max(1, steps_per_epoch):]
    summary = {
        "steps": step, "sequences": len(samples), "tokens": num_tokens,
        "target_weights": target_weights, "seconds": time.perf_counter() - start_time,
        "generate_seconds": gen_seconds,
        "loss_per_step": np.mean([h["loss"] for h in recent], axis=0).tolist(),
        "acc_per_step": np.mean([h["acc"] for h in recent], axis=0).tolist(),
    }
    with open(os.path.join(cfg.output_dir, "train_summary.json"), "w") as f:
        json.dump({"config": asdict(cfg), **summary}, f, indent=2)
    log(f"train-draft: {step} steps in {summary['seconds']:.0f} s; last epoch loss per TTT "
        f"step {[round(x, 3) for x in summary['loss_per_step']]}, accuracy "
        f"{[round(x, 3) for x in summary['acc_per_step']]}; head written to {cfg.output_dir}")
    return summary


def _data_model_len(cfg: TrainDraftConfig, model_dir: str) -> int | None:
    """The generating engine's max_model_len: the longest sequence trained on plus a response
    (a longer prompt trains nothing: its response starts past the cut), within the model's
    own limit. It bounds the KV cache, which at ``max_num_seqs`` = 256 must not be sized for
    the engine's default 2048 tokens per sequence."""
    limit = read_hf_config(model_dir).get("max_position_embeddings")
    length = cfg.max_seq_len + cfg.max_new_tokens
    return min(length, limit) if isinstance(limit, int) and limit > 0 else length


def _resumable(cfg: TrainDraftConfig) -> dict:
    """The settings a resumed run must share with the one that wrote the state."""
    keep = ("model", "draft_vocab_size", "ttt_steps", "epochs", "batch_size", "lr",
            "warmup_steps", "max_seq_len", "seed")
    return {k: getattr(cfg, k) for k in keep}
