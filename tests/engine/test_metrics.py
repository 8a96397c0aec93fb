"""SpecDecodingStats: vLLM's counter definitions, aggregation and the log line
(docs/design.md §8)."""

from __future__ import annotations

import logging
import re

import pytest

from verispec.engine.metrics import SpecDecodingLogger, SpecDecodingStats


def test_counters_follow_vllm_definitions():
    stats = SpecDecodingStats(3)
    stats.observe_step([3, 3, 0, 2], [3, 1, 0, 0])  # the 0-draft request is not counted
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 8
    assert stats.num_accepted_tokens == 4
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert stats.draft_acceptance_rate == pytest.approx(0.5)


def test_merge_and_errors():
    a, b = SpecDecodingStats(2), SpecDecodingStats(2)
    a.observe(2, 2)
    b.observe(2, 1)
    b.observe(1, 0)
    a.merge(b)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (3, 5, 3)
    assert a.num_accepted_tokens_per_pos == [2, 1]
    with pytest.raises(ValueError, match="k=3"):
        a.merge(SpecDecodingStats(3))
    with pytest.raises(ValueError, match=r"num_accepted_tokens must be in \[0, 2\], got 3"):
        a.observe(2, 3)
    empty = SpecDecodingStats(2)
    assert empty.mean_acceptance_length == 1.0 and empty.draft_acceptance_rate == 0.0


def test_log_line_format():
    stats = SpecDecodingStats(3)
    for n_accepted in [3, 2, 1, 0, 3]:
        stats.observe(3, n_accepted)
    line = stats.log_line(elapsed_s=2.0)
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.80, Accepted throughput: 4.50 tokens/s, "
        "Drafted throughput: 7.50 tokens/s, Accepted: 9 tokens, Drafted: 15 tokens, "
        "Per-position acceptance rate: 0.800, 0.600, 0.400, Avg Draft acceptance rate: 60.0%"
    )
    assert re.match(r"SpecDecoding metrics: Mean acceptance length: \d+\.\d\d", line)


def test_logger_intervals(caplog):
    log = SpecDecodingLogger(2, interval_s=10.0)
    step = SpecDecodingStats(2)
    step.observe(2, 1)
    log.observe(step)
    assert log.maybe_log(now=log.interval_start + 1.0) is None
    # the "verispec" logger prints to stderr itself and does not propagate (verispec.log), so
    # the capture listens on it directly
    logger = logging.getLogger("verispec.metrics")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="verispec.metrics"):
            line = log.maybe_log(now=log.interval_start + 10.0)
    finally:
        logger.removeHandler(caplog.handler)
    assert line is not None and "Accepted: 1 tokens" in line and line in caplog.text
    assert log.interval.num_drafts == 0 and log.total.num_drafts == 1
