"""Synthetic acceptance: measured rates match the configured ones.

Strategy: 100 000 verification steps (one per request, many requests per batch) through the real
RejectionSampler built from a SpeculativeConfig, counted with SpecDecodingStats exactly as the
engine counts them; per-position unconditional acceptance within +-0.01 of the configured rates
and mean acceptance length within +-0.02, for greedy rows, random rows and a mix.
"""

from __future__ import annotations

import pytest
import torch

from verispec import SpeculativeConfig
from verispec.engine.metrics import SpecDecodingStats
from verispec.ops import sampling
from verispec.sample import RejectionSampler, SamplingTensors

NUM_STEPS = 100_000
K = 4
VOCAB = 13


def measure(config: SpeculativeConfig, temperatures: list[float], device) -> SpecDecodingStats:
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(K + 1, VOCAB, generator=gen)
    draft_rows = rows[:K] + torch.randn(K, VOCAB, generator=gen)
    sampler = RejectionSampler(config, device=device)
    stats = SpecDecodingStats(K)
    batch = 25_000
    for start in range(0, NUM_STEPS, batch):
        temps = torch.tensor(temperatures).repeat(batch // len(temperatures) + 1)[:batch]
        tensors = SamplingTensors(
            temperature=temps.to(device), top_k=None, top_p=None, min_p=None,
            seeds=torch.arange(start, start + batch, dtype=torch.int64, device=device),
            all_greedy=temperatures == [0.0],
        )
        positions = torch.full((batch,), 9, dtype=torch.int64, device=device)
        draft_temps = tensors.temperature.repeat_interleave(K)
        drafts, q = sampling.sample_draft(
            draft_rows.to(device).repeat(batch, 1), draft_temps,
            tensors.seeds.repeat_interleave(K),
            (positions[:, None] + torch.arange(K, device=device)).reshape(-1),
        )
        out = sampler(
            rows.to(device).repeat(batch, 1), drafts,
            torch.arange(batch + 1, device=device) * K, q, tensors, positions,
        )
        accepted = (sampler.num_output_tokens(out) - 1).cpu().tolist()
        stats.observe_step([K] * batch, accepted)
    return stats


@pytest.mark.parametrize(
    "spec",
    [
        {"synthetic_acceptance_rates": [0.9, 0.6, 0.3, 0.1]},
        {"synthetic_acceptance_length": 2.5},
    ],
    ids=["rates", "length_2.5"],
)
@pytest.mark.parametrize(
    "temperatures", [[0.0], [1.0], [0.0, 0.7, 1.3]], ids=["greedy", "random", "mixed"]
)
def test_measured_rates_match_configured(spec, temperatures, device):
    config = SpeculativeConfig(
        num_speculative_tokens=K, rejection_sample_method="synthetic", **spec
    )
    stats = measure(config, temperatures, device)
    assert stats.num_drafts == NUM_STEPS
    for measured, configured in zip(stats.acceptance_rate_per_pos, config.unconditional_rates):
        assert measured == pytest.approx(configured, abs=0.01)
    assert stats.mean_acceptance_length == pytest.approx(config.mean_acceptance_length, abs=0.02)
