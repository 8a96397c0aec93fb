"""``verispec bench``: a prompt set with and without speculation, in one run.

For each configuration the same prompts run through a fresh ``LLM`` (greedy unless the sampling
flags say otherwise); reported per run: generated tokens/s, speedup over the no-speculation run,
mean acceptance length, per-position acceptance, and the Leviathan et al. prediction from the
measured acceptance and the measured costs: ``c`` = proposer time per draft token over a plain
decode step, ``verify_cost`` = verify step over a plain decode step (REFERENCE §10).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from verispec.config import SpeculativeConfig
from verispec.engine.bench_utils import leviathan_prediction, progress
from verispec.engine.llm import LLM
from verispec.sampling_params import SamplingParams


def _run(llm: LLM, prompts: Sequence[Any], params: SamplingParams, batch_size: int,
         label: str) -> tuple[int, float, int]:
    """Generate for every prompt in batches; returns (generated tokens, seconds, engine steps)."""
    num_tokens, elapsed, steps_before = 0, 0.0, llm.num_steps
    for start in progress(range(0, len(prompts), batch_size), desc=label, unit="batch"):
        chunk = list(prompts[start:start + batch_size])
        begin = time.perf_counter()
        outs = llm.generate(chunk, params)
        elapsed += time.perf_counter() - begin
        num_tokens += sum(len(o.token_ids) for o in outs)
    return num_tokens, elapsed, llm.num_steps - steps_before


def run_bench(
    engine_kwargs: dict,
    spec_configs: Sequence[SpeculativeConfig],
    prompts: Sequence[Any],
    params: SamplingParams,
    batch_size: int = 1,
) -> list[dict]:
    """One row per configuration, the no-speculation baseline first (``k`` = 0)."""
    llm = LLM(**engine_kwargs, speculative_config=None)
    _run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), 1, "warm-up")
    tokens, seconds, steps = _run(llm, prompts, params, batch_size, "no speculation")
    base_tps = tokens / seconds
    plain_step_s = seconds / max(steps, 1)
    rows = [{"method": "none", "k": 0, "tokens": tokens, "seconds": seconds,
             "tokens_per_s": base_tps, "speedup": 1.0, "mean_acceptance_length": 1.0,
             "acceptance_rate_per_pos": []}]
    for config in spec_configs:
        llm = LLM(**engine_kwargs, speculative_config=config)
        label = f"{config.method} k={config.num_speculative_tokens}"
        tokens, seconds, _ = _run(llm, prompts, params, batch_size, label)
        spec = llm.spec
        stats = spec.stats
        steps = max(spec.num_steps, 1)
        c = spec.propose_time_s / steps / config.num_speculative_tokens / plain_step_s
        verify_cost = spec.verify_time_s / steps / plain_step_s
        row = {
            "method": config.method,
            "k": config.num_speculative_tokens,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "speedup": tokens / seconds / base_tps,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
            "draft_acceptance_rate": stats.draft_acceptance_rate,
            "c": c,
            "verify_cost": verify_cost,
            "label": config.method,
        }
        if stats.num_drafts:
            row.update(leviathan_prediction(stats.acceptance_rate_per_pos, c, verify_cost))
        row["log_line"] = stats.log_line(seconds)
        rows.append(row)
    return rows
