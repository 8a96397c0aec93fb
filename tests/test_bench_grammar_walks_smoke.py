"""``benchmarks/bench_grammar_walks.py`` end to end on the CPU (the bundled model drafting for
itself): the greedy walk computes fewer masks while drafting than the eager one, the same tokens
come out, and the library's functions are its own again afterwards."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

from verispec.proposers import grammar_walk
from verispec.sample import grammar

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_greedy_walks_mask_less_while_drafting(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (its import of bench_grammar_drafting)
    spec = importlib.util.spec_from_file_location("bench_grammar_walks",
                                                  BENCHMARKS / "bench_grammar_walks.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_grammar_walks", module)
    spec.loader.exec_module(module)
    before = (grammar.compute_masks, grammar_walk.GrammarWalks.argmax)
    result = module.main(["--requests", "2", "--tokens", "16"])
    assert (grammar.compute_masks, grammar_walk.GrammarWalks.argmax) == before
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    eager, greedy = result["rows"]
    assert result["same_tokens"] and eager["tokens"] == greedy["tokens"] > 2
    assert greedy["masks_drafting"] < eager["masks_drafting"]
