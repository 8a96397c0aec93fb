"""``benchmarks/profile_spec_host.py`` end to end on the CPU with tiny models.

Strategy: the script's ``main`` with ``--tiny --device cpu`` runs plain decoding and both
proposers; its JSON line has a row per engine, each speculative engine's phases include the
proposer's and the verify's, and an unknown engine is one clear error. No timing is checked
(CPU figures of tiny models mean nothing).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_spec_host.py"


def load_script():
    spec = importlib.util.spec_from_file_location("profile_spec_host", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_prints_one_json_line(tmp_path, capsys):
    bench = load_script()
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add waiting on a busy machine
    try:
        bench.main(["--tiny", "--device", "cpu", "--batch", "4", "--tokens", "8",
                    "--workdir", str(tmp_path)])
    finally:
        torch.set_num_threads(num_threads)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["benchmark"] == "profile_spec_host"
    assert [r["engine"] for r in result["results"]] == ["plain", "draft", "eagle"]
    for r in result["results"]:
        assert r["decode_tok_s"] > 0 and r["step_ms"] > 0 and r["phases_us"]["step"] > 0
        if r["engine"] != "plain":
            assert {"propose", "verify", "proposer on_commit", "commit"} <= set(r["phases_us"])
            assert r["vs_plain"] > 0 and 1.0 <= r["accept_len"] <= 4.0


def test_unknown_engine_is_one_clear_error():
    bench = load_script()
    with pytest.raises(SystemExit, match="--proposers: unknown engine 'ngram'"):
        bench.main(["--tiny", "--device", "cpu", "--proposers", "plain,ngram"])
