"""``benchmarks/bench_throughput.py`` end to end on the CPU with a tiny random target.

Strategy: the script as a user runs it (``--tiny``, its engine in a subprocess) with
``--profile-window``: the JSON line must hold every request's tokens and a breakdown of the run's
steps that adds up (steps with prefill plus decode-only steps are all the steps, the tail is
a part of them), and the profile must print its per-step lines and the host functions. No timing
is checked: CPU figures of a tiny model mean nothing.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_throughput.py"


def test_tiny_run_with_a_profile_window(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--num-requests", "12",
         "--workdir", str(tmp_path), "--profile-window", "2:3"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    (row,) = result["rows"]
    assert row["requests"] == 12 and row["output_tokens"] > 0
    steps = row["prefill_steps"] + row["decode_steps"]
    assert steps > 5 and 0 <= row["tail_steps"] <= steps
    assert row["tail_s"] <= row["prefill_s"] + row["decode_s"] + 1e-9
    text = proc.stdout
    assert "steps 2..4:" in text and "mean wall" in text  # the torch profiler's window
    assert "steps 5..7 on the host" in text  # then cProfile's
