"""``benchmarks/profile_spec_host.py`` end to end on the CPU with tiny models.

Strategy: the script as a user runs it (``--tiny --device cpu``) runs plain decoding and both
proposers; its JSON line has a row per engine, each speculative engine's phases include the
proposer's and the verify's, and an unknown engine is one clear error. No timing is checked
(CPU figures of tiny models mean nothing).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_spec_host.py"


def run(*args: str) -> subprocess.CompletedProcess:
    # tiny matrices: threads only add waiting on a busy machine
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600, env=env)


def test_tiny_cpu_run_prints_one_json_line(tmp_path):
    proc = run("--batch", "4", "--tokens", "8", "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "profile_spec_host"
    assert [r["engine"] for r in result["results"]] == ["plain", "draft", "eagle"]
    for r in result["results"]:
        assert r["decode_tok_s"] > 0 and r["step_ms"] > 0 and r["phases_us"]["step"] > 0
        if r["engine"] != "plain":
            assert {"propose", "verify", "proposer on_commit", "commit"} <= set(r["phases_us"])
            assert r["vs_plain"] > 0 and 1.0 <= r["accept_len"] <= 4.0


def test_unknown_engine_is_one_clear_error():
    proc = run("--proposers", "plain,ngram")
    assert proc.returncode != 0
    assert "--proposers: unknown engine 'ngram'" in proc.stderr
    assert "Traceback" not in proc.stderr
