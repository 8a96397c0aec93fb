"""``benchmarks/bench_serving.py`` end to end on the CPU, and its workload and ITL arithmetic.

Strategy: the script's ``main`` serves a tiny random target with the EAGLE-3 configuration
(synthetic acceptance, so streamed chunks carry several tokens) at two request rates; the JSON
line must parse, hold every metric of the table for each rate, and count every request and token
of the seeded workload (no timing is checked: CPU figures of a tiny model mean nothing). The
workload, the arrival times and the per-token ITL split are checked on their own, without a
server.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving",
                                                  BENCHMARKS / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tiny_model_two_rates_prints_one_json_line(bench, tmp_path, capsys):
    bench.main(["--random-model", "tiny", "--workdir", str(tmp_path / "models"),
                "--dtype", "float32", "--configs", "eagle3", "--request-rates", "8,inf",
                "--num-prompts", "6", "--num-warmup", "2", "--scale", "0.05",
                "--max-num-seqs", "4", "--max-model-len", "256", "--log-dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert result["benchmark"] == "bench_serving"
    assert result["request_rates"] == [8.0, "inf"]
    [config] = result["configs"]
    assert config["config"] == "eagle3"
    assert config["speculative_config"]["synthetic_acceptance_length"] == 2.5
    workload = bench.sharegpt_workload(6, 0, 0.05, 256)
    assert config["num_prompt_tokens"] == sum(workload.prompt_lens)
    assert config["num_output_tokens"] == sum(workload.output_lens)
    assert [p["request_rate"] for p in config["passes"]] == [8.0, "inf"]
    for row in config["passes"]:
        assert row["completed"] == 6 and row["failed"] == 0, row["first_errors"]
        assert row["total_input_tokens"] == config["num_prompt_tokens"]
        assert row["total_output_tokens"] == config["num_output_tokens"]  # ignore_eos
        for key in bench.TABLE_COLUMNS:
            assert key in row, key
        for key in ("request_throughput", "output_throughput", "total_token_throughput",
                    "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms"):
            assert row[key] > 0, key
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["total_token_throughput"] > row["output_throughput"]
        assert 1.0 <= row["mean_acceptance_length"] <= 4.0
        assert row["mean_tokens_per_chunk"] > 1.0  # speculation: chunks of several tokens
        assert row["client_lag_p50_ms"] >= 0


def test_workload_is_seeded_and_sharegpt_shaped(bench):
    a = bench.sharegpt_workload(2000, seed=3)
    assert a == bench.sharegpt_workload(2000, seed=3)
    prompts = a.prompts(1000, seed=3, token_seed=1)
    assert prompts == a.prompts(1000, seed=3, token_seed=1)
    assert prompts[0] != a.prompts(1000, seed=3, token_seed=2)[0]  # each pass its own ids
    prompt_lens = np.array([len(p) for p in prompts])
    assert 200 <= np.median(prompt_lens) <= 300
    assert 160 <= np.median(a.output_lens) <= 240
    assert prompt_lens.min() >= 4 and prompt_lens.max() <= 1024
    assert min(a.output_lens) >= 4 and max(a.output_lens) <= 1024
    assert all(0 <= t < 1000 for p in prompts for t in p)
    short = bench.sharegpt_workload(200, seed=3, max_model_len=300)
    assert all(p + n <= 300 for p, n in zip(short.prompt_lens, short.output_lens))


def test_arrivals_are_poisson_at_the_rate(bench):
    offsets = bench.arrival_offsets(4000, 16.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 4000 == pytest.approx(1 / 16, rel=0.05)
    assert bench.arrival_offsets(5, math.inf, seed=0) == [0.0] * 5


def test_itl_splits_a_chunk_over_its_tokens(bench):
    result = bench.Result(chunk_times=[1.0, 1.1, 1.4], chunk_tokens=[2, 1, 3])
    itls = bench.per_token_itls(result)
    assert itls == pytest.approx([0.1, 0.1, 0.1, 0.1])  # the first chunk's tokens: none
    assert sum(itls) == pytest.approx(0.4)
