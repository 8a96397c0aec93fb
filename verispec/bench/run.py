"""``verispec bench``: a prompt set with and without speculation, in one run.

For each configuration the same prompts run through a fresh ``LLM`` (greedy unless the sampling
flags say otherwise); reported per run: generated tokens/s, speedup over the no-speculation run,
mean acceptance length, per-position acceptance, and the Leviathan et al. prediction from the
measured acceptance, the measured draft rate (decode steps in which the proposer drafted; the
others emit one token) and the measured costs, in plain decode steps (prefill left out, timed by
a max_tokens=1 pass): ``c`` = proposer time per draft token, ``verify_cost`` = verify time per
step, ``step_cost`` = a whole speculative decode step (docs/design.md §10); then measured /
predicted. Each
engine first runs the first batch untimed, so kernels compiled on first use are not timed; a row
counts its timed pass alone.

Prompts are text or token ids. Token-id prompts (a JSONL file of ``prompt_token_ids``, or
``RandomPrompts`` drawn from the loaded model's vocabulary) need no tokenizer, so a bare model
directory (config.json + safetensors) can be benchmarked.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verispec.bench.prompts import Prompt, RandomPrompts
from verispec.bench.report import leviathan_prediction, progress
from verispec.config import SpeculativeConfig
from verispec.engine import inputs
from verispec.engine.llm import LLM
from verispec.engine.metrics import SpecDecodingStats
from verispec.sampling_params import SamplingParams


def prepare_prompts(llm: LLM, prompts: Sequence[Prompt] | RandomPrompts, chat: bool) -> list:
    """The prompts to send to ``llm.generate``, each checked before any run.

    ``RandomPrompts`` are drawn from ``llm``'s vocabulary. Text prompts need the model's tokenizer
    and become one user message when ``chat`` and the tokenizer has a chat template; token ids are
    sent as they are. ValueError names the first prompt the model cannot take (no tokenizer for
    text, an id outside the vocabulary, no room under ``max_model_len``).
    """
    if isinstance(prompts, RandomPrompts):
        prompts = prompts.token_ids(llm.model_config.vocab_size)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to run")
    if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise ValueError(
            "the model has no tokenizer, so text prompts cannot be encoded: use token-id prompts "
            '(--prompts random, or a JSONL file of {"prompt_token_ids": [...]} lines)'
        )
    if chat and getattr(llm.tokenizer, "chat_template", None):
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p
                   for p in prompts]
    for i, prompt in enumerate(prompts):
        try:
            _, ids = inputs.encode_prompt(prompt, llm.tokenizer, llm.model_config.vocab_size)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        if len(ids) >= llm.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, but max_model_len={llm.max_model_len} leaves "
                "no room to generate (raise --max-model-len or shorten the prompt)"
            )
    return prompts


@dataclass
class _Measured:
    """What one timed pass over the prompts measured, and nothing from before it."""

    num_tokens: int = 0  # generated
    num_requests: int = 0
    seconds: float = 0.0  # inside generate
    num_steps: int = 0  # engine steps (prefill and decode)
    stats: SpecDecodingStats | None = None  # the requests' merged counters (speculation only)
    propose_s: float = 0.0  # proposer wall time (speculation only)
    verify_s: float = 0.0  # verify wall time (speculation only)
    num_spec_steps: int = 0  # speculative steps (speculation only)


def _spec_counters(llm: LLM) -> tuple[float, float, int]:
    spec = llm.spec
    return (0.0, 0.0, 0) if spec is None else (spec.propose_time_s, spec.verify_time_s,
                                               spec.num_steps)


def _run(llm: LLM, prompts: Sequence[Any], params: SamplingParams, batch_size: int,
         label: str) -> _Measured:
    """Generate for every prompt in batches of ``batch_size``; what this pass alone measured."""
    measured = _Measured(stats=None if llm.spec is None else SpecDecodingStats(llm.spec.k))
    steps_before, spec_before = llm.num_steps, _spec_counters(llm)
    for start in progress(range(0, len(prompts), batch_size), desc=label, unit="batch"):
        chunk = list(prompts[start:start + batch_size])
        begin = time.perf_counter()
        outs = llm.generate(chunk, params)
        measured.seconds += time.perf_counter() - begin
        for i, out in enumerate(outs):
            if out.error is not None:  # a failed request would count as zero tokens
                raise ValueError(f"prompt {start + i}: {out.error}")
            measured.num_tokens += len(out.token_ids)
            measured.num_requests += 1
            if measured.stats is not None and out.spec_stats is not None:
                measured.stats.merge(out.spec_stats)
    measured.num_steps = llm.num_steps - steps_before
    spec_after = _spec_counters(llm)
    measured.propose_s = spec_after[0] - spec_before[0]
    measured.verify_s = spec_after[1] - spec_before[1]
    measured.num_spec_steps = spec_after[2] - spec_before[2]
    return measured


def _warm_up(llm: LLM, prompts: Sequence[Any], params: SamplingParams, batch_size: int) -> None:
    """The first batch, run in full and untimed: kernels compiled or loaded on first use (Triton
    on CUDA, for every context length and draft count the run reaches) are ready before timing.
    A shorter pass is not enough: a full pass compiles variants a shorter one never meets, and
    the timed pass would pay for them."""
    _run(llm, prompts[:batch_size], params, batch_size, "warm-up")


def draft_rate(m: _Measured) -> float:
    """The fraction of the requests' decode steps in which the proposer drafted. A decode step
    emits 1 + accepted tokens when it drafted and 1 when not, and prefill one token per request,
    so the steps without drafts are ``tokens - requests - drafts - accepted`` (a step cut short
    by max_tokens or a stop makes this a slight undercount)."""
    stats = m.stats
    undrafted = max(0, m.num_tokens - m.num_requests - stats.num_drafts
                    - stats.num_accepted_tokens)
    total = stats.num_drafts + undrafted
    return stats.num_drafts / total if total else 1.0


def _free_device_memory() -> None:
    """Return a dropped engine's device memory (weights, KV cache, graph pools) to the device
    before the next engine is built, so that two never hold the GPU's memory at once."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _baseline_row(llm: LLM, prompts: Sequence[Any], params: SamplingParams,
                  batch_size: int) -> tuple[dict, float, float]:
    """The no-speculation row, the mean plain decode step and the prefill time of the prompts
    (a pass with max_tokens=1), in seconds. Prefill steps are left out of the decode step: a
    prompt of hundreds of tokens costs several decode steps."""
    _warm_up(llm, prompts, params, batch_size)
    prefill = _run(llm, prompts, dataclasses.replace(params, max_tokens=1), batch_size,
                   "prefill")
    m = _run(llm, prompts, params, batch_size, "no speculation")
    row = {"method": "none", "k": 0, "tokens": m.num_tokens, "seconds": m.seconds,
           "tokens_per_s": m.num_tokens / m.seconds, "speedup": 1.0,
           "mean_acceptance_length": 1.0, "acceptance_rate_per_pos": []}
    decode_s = max(m.seconds - prefill.seconds, 1e-9)
    return row, decode_s / max(m.num_steps - prefill.num_steps, 1), prefill.seconds


def tree_label(config: SpeculativeConfig) -> str:
    """How a configuration drafts: ``chain``, ``static N`` (a tree of N nodes) or ``topk K,
    N`` (EAGLE-2's dynamic tree, N tokens verified)."""
    if config.speculative_token_tree is not None:
        return f"static {len(config.speculative_token_tree)}"
    if config.speculative_eagle_topk is not None:
        return f"topk {config.speculative_eagle_topk}, {config.speculative_num_draft_tokens}"
    return "chain"


def _speculative_row(engine_kwargs: dict, config: SpeculativeConfig, prompts: Sequence[Any],
                     params: SamplingParams, batch_size: int, base_tps: float,
                     plain_step_s: float, prefill_s: float) -> dict:
    """The row of one speculative configuration, on an engine of its own (freed on return).

    The prediction: expected tokens per decode step from the acceptance (Leviathan et al.) and
    the draft rate, times the measured cost of a speculative decode step (``step_cost``: the
    decode time over the speculative steps, in plain decode steps; proposing, verifying and the
    step's bookkeeping), plus the prompts' prefill time, gives the predicted run time."""
    llm = LLM(**engine_kwargs, speculative_config=config)
    _warm_up(llm, prompts, params, batch_size)
    k = config.num_speculative_tokens
    m = _run(llm, prompts, params, batch_size, f"{config.method} k={k}")
    stats = m.stats
    steps = max(m.num_spec_steps, 1)
    c = m.propose_s / steps / k / plain_step_s
    verify_cost = m.verify_s / steps / plain_step_s
    step_cost = max(m.seconds - prefill_s, 1e-9) / steps / plain_step_s
    row = {
        "method": config.method,
        "k": k,
        "tokens": m.num_tokens,
        "seconds": m.seconds,
        "tokens_per_s": m.num_tokens / m.seconds,
        "speedup": m.num_tokens / m.seconds / base_tps,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
        "draft_acceptance_rate": stats.draft_acceptance_rate,
        "c": c,
        "verify_cost": verify_cost,
        "step_cost": step_cost,
        "label": config.method,
        "tree": tree_label(config),
    }
    if stats.num_drafts:
        row.update(leviathan_prediction(stats.acceptance_rate_per_pos, c, verify_cost,
                                        draft_rate(m)))
        num_decode_tokens = m.num_tokens - m.num_requests  # prefill gives each request one
        predicted_s = prefill_s + (num_decode_tokens / row["predicted_tokens_per_step"]
                                   * step_cost * plain_step_s)
        row["predicted_speedup"] = m.num_tokens / predicted_s / base_tps
        row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup"]
    row["log_line"] = stats.log_line(m.seconds)
    return row


def run_bench(
    engine_kwargs: dict,
    spec_configs: Sequence[SpeculativeConfig],
    prompts: Sequence[Prompt] | RandomPrompts,
    params: SamplingParams,
    batch_size: int = 1,
    chat: bool = False,
) -> list[dict]:
    """One row per configuration, the no-speculation baseline first (``k`` = 0).

    ``prompts`` are prepared once, on the baseline engine (``prepare_prompts``): random ones
    drawn, text sent as chat when ``chat`` and the model has a chat template, all checked before
    the timed runs. ``params`` go to every request as given (``ignore_eos`` included). Each
    configuration runs on a fresh engine, built after the previous one is freed.
    """
    llm = LLM(**engine_kwargs, speculative_config=None)
    prompts = prepare_prompts(llm, prompts, chat)
    baseline, plain_step_s, prefill_s = _baseline_row(llm, prompts, params, batch_size)
    del llm
    rows = [baseline]
    for config in spec_configs:
        _free_device_memory()
        rows.append(_speculative_row(engine_kwargs, config, prompts, params, batch_size,
                                     baseline["tokens_per_s"], plain_step_s, prefill_s))
    return rows
