"""``benchmarks/bench_options.py`` end to end on the CPU (the bundled model, n-gram drafts): the
table's rows, the JSON line, and ``--phases`` timing a JSON-schema row's step phases with every
wrapped function put back afterwards."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

from tests.models.utils import requires_bundled
from verispec.proposers import grammar_walk
from verispec.sample import grammar, options

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@requires_bundled
def test_rows_and_phases(capsys, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (its imports of the other benchmarks)
    spec = importlib.util.spec_from_file_location("bench_options",
                                                  BENCHMARKS / "bench_options.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_options", module)
    spec.loader.exec_module(module)
    before = (grammar.compute_masks, grammar_walk.extend_drafts, options.fill_chain_masks,
              grammar_walk.GrammarWalks.apply, module.LLM._step)
    result = module.main(["--device", "cpu", "--model", "bundled", "--batch", "2", "--tokens",
                          "8", "--spec", "ngram", "--rows", "plain,json", "--phases", "json",
                          "--workdir", str(tmp_path)])
    assert (grammar.compute_masks, grammar_walk.extend_drafts, options.fill_chain_masks,
            grammar_walk.GrammarWalks.apply, module.LLM._step) == before
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    plain, schema = result["rows"]
    assert plain["row"] == "plain" and schema["row"] == "json" and schema["tokens"] > 2
    phases = result["phases_us"]
    assert phases["spec step"] >= phases["options"] > 0 and phases["compute_masks"] > 0
