"""``benchmarks/bench_hybrid_gpu.py`` end to end on the CPU with a tiny hybrid model.

Strategy: the script's ``main`` with ``--tiny --device cpu --quick`` builds the checkpoint, times
the steps (eagerly: no graphs on CPU) and both engines, prints its tables and one JSON line; the
line must parse, match ``--json-out`` and hold the keys a reader of the GPU run relies on (no
timing is checked: CPU figures of a tiny model mean nothing).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hybrid_gpu.py"


def test_tiny_cpu_run_prints_one_json_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_hybrid_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    json_out = tmp_path / "result.json"
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add waiting on a busy machine
    try:
        bench.main(["--tiny", "--device", "cpu", "--quick", "--dtype", "float32",
                    "--workdir", str(tmp_path / "models"), "--json-out", str(json_out)])
    finally:
        torch.set_num_threads(num_threads)
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result == json.loads(json_out.read_text())
    assert result["benchmark"] == "bench_hybrid_gpu" and result["k"] == bench.K
    memory = result["memory"]
    assert memory["ring_positions"] == bench.K + 2 and memory["mamba_layers"] == 3
    assert memory["state_bytes"] == memory["position_bytes"] * bench.BATCH * (bench.K + 2)
    assert [row["B"] for row in result["steps"]] == [1, 4]
    for row in result["steps"]:
        for key in ("decode_us", "verify_us", "verify_x_decode", "decode_ssm_pct",
                    "verify_ssm_pct"):
            assert row[key] > 0, key
    runs = {row["run"]: row for row in result["runs"]}
    assert set(runs) == {"b1 plain", "b1 synthetic", "b4 plain", "b4 synthetic"}
    for name in ("b1 synthetic", "b4 synthetic"):
        row = runs[name]
        assert 1.0 <= row["accept_len"] <= 1 + bench.K
        assert row["speedup"] > 0 and row["predicted"] > 0 and row["step_cost"] >= 1.0
