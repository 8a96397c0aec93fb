"""``benchmarks/bench_long_context.py`` end to end on the CPU with a tiny random target.

Strategy: the script as a user runs it (``--tiny``, both engines in subprocesses): the JSON line
has a row per case, both engines gave the same tokens, and a bad ``--cases`` is one clear
error. No timing is checked: split-KV is a GPU launch shape, and CPU figures mean nothing.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_long_context.py"


def test_tiny_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--tokens", "4",
         "--cases", "1x40,2x90", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 40), (2, 90)]
    assert all(r["same_tokens"] and r["split_tok_s"] > 0 for r in result["rows"])


def test_bad_cases_is_one_clear_error():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "1x40,big"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--cases: 'big' is not BxL" in proc.stderr
