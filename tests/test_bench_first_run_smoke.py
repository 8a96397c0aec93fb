"""``benchmarks/bench_first_run.py`` on the CPU with a tiny random target.

Strategy: the script as a user runs it (a subprocess: it sets ``TRITON_CACHE_DIR`` before
anything imports Triton); its JSON line has both runs and the kernel counts (none on the CPU).
No timing is checked."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_first_run.py"


def test_tiny_run():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu",
                           "--requests", "4"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "first_run" and result["requests"] == 4
    assert result["first_run_s"] > 0 and result["again_s"] > 0
    assert result["kernels_at_startup"] == 0 and result["kernels_mid_run"] == {}
