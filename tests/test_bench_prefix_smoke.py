"""``benchmarks/bench_prefix.py`` end to end on the CPU with a tiny random target.

Strategy: the script's ``main`` with ``--tiny --device cpu`` runs both scenarios, each with its
feature on and off (``enable_prefix_caching``, ``enable_chunked_prefill``); the JSON line must
parse and hold what a reader of the GPU run relies on. Checked beyond the structure: greedy
outputs are identical with and without prefix caching, the cache serves most of the prompt of
later turns (each repeats the whole conversation) and nothing without it, and every stream token
after the first gives one inter-token latency. No timing is checked: CPU figures of a tiny model
mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_prefix.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_prefix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_prefix"] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_prints_one_json_line(tmp_path, capsys):
    bench = load_script()
    bench.main(["--tiny", "--device", "cpu", "--workdir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert result["benchmark"] == "bench_prefix"
    sizes = result["sizes"]
    chat = result["chat"]
    assert set(chat["runs"]) == {"caching", "no caching"}
    assert chat["compared"] == sizes["num_conversations"] * sizes["num_turns"]
    assert chat["mismatches"] == 0
    for row in chat["runs"].values():
        assert row["requests"] == chat["compared"]
        for key in ("turn1_ttft_p50_ms", "turn1_ttft_p99_ms", "later_ttft_p50_ms",
                    "later_ttft_p99_ms", "output_tokens_per_s"):
            assert row[key] > 0, key
    assert chat["runs"]["caching"]["later_hit_rate"] > 0.5
    assert chat["runs"]["no caching"]["hit_rate"] == 0
    assert chat["later_ttft_p50_ratio"] > 0 and chat["goal"] == bench.CHAT_GOAL

    long = result["long"]
    assert set(long["runs"]) == {"chunked", "not chunked"}
    for row in long["runs"].values():
        assert row["num_itls"] == sizes["num_streams"] * (sizes["stream_output_len"] - 1)
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
        assert row["worst_over_median"] >= 1 and row["long_ttft_ms"] > 0
    assert long["goal"] == bench.LONG_GOAL
