"""Statistics helpers for the exactness suite: an independent float64 reference of the processed
distribution, and a chi-square goodness-of-fit test with small bins merged."""

from __future__ import annotations

import json
import os

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0
P_VALUE_THRESHOLD = 1e-6


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Processed distribution of one row in float64, written from docs/design.md §3 with numpy
    only."""
    z = np.asarray(logits, dtype=np.float64) / (temperature if temperature > 0 else 1.0)
    vocab = z.shape[0]
    if 0 < top_k < vocab:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        sorted_p = np.sort(p)[::-1]
        mass_before = np.cumsum(sorted_p) - sorted_p
        num_kept = max(1, int((mass_before < top_p).sum()))
        p = np.where(p < sorted_p[num_kept - 1], 0.0, p)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p < min_p * p.max(), 0.0, p)
        p /= p.sum()
    return p


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed token counts to probs.

    A token with probability 0 that was emitted is an outright failure (returns 0). Bins with an
    expected count under 5 are merged into one.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if n == 0:
        return 1.0
    if counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    expected = n * probs[support] / probs[support].sum()
    observed = counts[support]
    small = expected < MIN_EXPECTED
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    if expected.size < 2:
        return 1.0
    return float(stats.chisquare(observed, expected).pvalue)


def record(case: str, num_samples: int, p_values: list[float]) -> None:
    """Append a case's result to the file named by VERISPEC_STATS_REPORT, if set."""
    path = os.environ.get("VERISPEC_STATS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "num_samples": num_samples,
                                "min_p_value": min(p_values), "p_values": p_values}) + "\n")


def reference_option_logits(logits, prompt, output, *, repetition_penalty=1.0,
                            frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None,
                            allowed_token_ids=None, bad_words=(), min_tokens=0,
                            stop_ids=()) -> np.ndarray:
    """The logits of one row after the sampling options, in float64, written from
    docs/design.md §15 with numpy only: ``output`` is everything generated before the row
    (committed tokens and the drafts before it); ``bad_words`` are token-id sequences."""
    z = np.asarray(logits, dtype=np.float64).copy()
    vocab = z.shape[0]
    if allowed_token_ids is not None:
        keep = np.zeros(vocab, dtype=bool)
        keep[list(allowed_token_ids)] = True
        z[~keep] = -np.inf
    output = list(output)
    for word in bad_words:
        before = list(word[:-1])
        if not before or (len(output) >= len(before) and output[len(output) - len(before):]
                          == before):
            z[word[-1]] = -np.inf
    if len(output) < min_tokens:
        z[list(stop_ids)] = -np.inf
    for token, bias in (logit_bias or {}).items():
        z[token] += bias
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab).astype(np.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    with np.errstate(invalid="ignore"):
        penalised = np.where(z > 0, z / repetition_penalty, z * repetition_penalty)
    z = np.where(seen, penalised, z)
    return z - frequency_penalty * counts - presence_penalty * (counts > 0)
