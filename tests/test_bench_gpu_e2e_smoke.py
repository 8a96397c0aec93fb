"""``benchmarks/bench_gpu_e2e.py`` end to end on the CPU with tiny models.

Strategy: the script's ``main`` with ``--tiny --device cpu --quick --skip-hf`` builds both tiny
checkpoints, runs every engine and prints its tables and one JSON line; the line must parse, have
the keys a reader of the GPU run relies on, match ``--json-out``, and the greedy determinism
checks must hold (no timing is checked: CPU figures of tiny models mean nothing).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_e2e.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_prints_one_json_line(tmp_path, capsys):
    bench = load_script()
    json_out = tmp_path / "result.json"
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add waiting on a busy machine
    try:
        bench.main(["--tiny", "--device", "cpu", "--quick", "--skip-hf",
                    "--workdir", str(tmp_path / "models"), "--json-out", str(json_out)])
    finally:
        torch.set_num_threads(num_threads)
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result == json.loads(json_out.read_text())

    for key in ("benchmark", "device", "torch", "copy_bandwidth_gb_s", "target_weight_bytes",
                "roofline_step_ms", "roofline_tok_s_b1", "roofline_tok_s_batch", "runs",
                "eager", "engines", "kernels", "determinism", "hf", "goals"):
        assert key in result, key
    assert result["benchmark"] == "bench_gpu_e2e"
    assert result["hf"] == []
    assert set(result["runs"]) == {"b1 plain", "b1 draft", "b64 plain", "b64 draft",
                                   "b1 eagle", "b64 eagle", "b1 plain eager", "b64 plain eager"}
    for name, row in result["runs"].items():
        assert row["tokens"] == row["B"] * (64 if row["B"] == 1 else 32), name
        assert row["out_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["ttft_ms"] > 0
        assert row["roofline_pct"] > 0
    for name in ("b1 draft", "b64 draft", "b1 eagle", "b64 eagle"):
        row = result["runs"][name]
        for key in ("accept_len", "speedup", "predicted", "measured_x_predicted",
                    "propose_cost", "verify_cost"):
            assert row[key] > 0, (name, key)
        assert 1.0 <= row["accept_len"] <= 1 + bench.K
    assert [r["eager"] for r in result["kernels"]] == [False, True]
    assert len(result["engines"]) == 4
    checks = {c["check"]: c for c in result["determinism"]}
    assert set(checks) == {"repeat", "alone_vs_batch", "graphs_vs_eager"}
    assert all(c["identical"] and c["first_diff"] is None for c in checks.values()), checks
    assert {g["goal"] for g in result["goals"]} >= set(bench.GOALS) | set(bench.MAX_GOALS)
