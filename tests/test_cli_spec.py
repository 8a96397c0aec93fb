"""CLI: speculative flags map onto SpeculativeConfig, and ``verispec bench`` runs end to end.

Strategy: flag parsing is checked without a model (every flag, the JSON form, the conflicts);
``bench`` runs on a tiny random model with the bundled tokenizer and must print the table, one
JSON line and write the JSON and plot files.
"""

from __future__ import annotations

import json

import pytest

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from verispec import cli
from verispec.config import SpeculativeConfig


def parse(*argv):
    return cli.build_parser().parse_args(["generate", "hi", *argv])


def test_default_is_ngram_and_none_switches_off():
    assert cli.speculative_config(parse()) == SpeculativeConfig(method="ngram")
    assert cli.speculative_config(parse("--speculative-method", "none")) is None
    assert cli.speculative_config(parse("--speculative-config", '{"method": "none"}')) is None


def test_every_flag_maps_onto_its_field():
    config = cli.speculative_config(parse(
        "--speculative-method", "draft_model", "--num-speculative-tokens", "4",
        "--draft-model", "/m", "--draft-sample-method", "probabilistic",
    ))
    assert (config.method, config.num_speculative_tokens, config.model) == ("draft_model", 4, "/m")
    assert config.draft_sample_method == "probabilistic"
    config = cli.speculative_config(parse("--prompt-lookup-min", "2", "--prompt-lookup-max", "3"))
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 3)
    with pytest.raises(ValueError, match="'draft_model' does not use prompt_lookup_min=2"):
        cli.speculative_config(parse("--speculative-method", "draft_model", "--draft-model",
                                     "/m", "--prompt-lookup-min", "2"))
    config = cli.speculative_config(parse("--speculative-method", "early_exit",
                                          "--draft-layers", "6"))
    assert config.num_draft_layers == 6
    config = cli.speculative_config(parse("--synthetic-acceptance-length", "2.5",
                                          "--num-speculative-tokens", "4"))
    assert config.is_synthetic and config.mean_acceptance_length == pytest.approx(2.5)
    config = cli.speculative_config(parse("--synthetic-acceptance-rates", "0.9,0.5,0.2"))
    assert config.unconditional_rates == (0.9, 0.5, 0.2)


def test_json_config_and_its_errors():
    config = cli.speculative_config(parse(
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'))
    assert config.num_speculative_tokens == 5
    with pytest.raises(ValueError, match="cannot be combined with --num-speculative-tokens"):
        cli.speculative_config(parse("--speculative-config", "{}",
                                     "--num-speculative-tokens", "2"))
    with pytest.raises(ValueError, match="not valid JSON"):
        cli.speculative_config(parse("--speculative-config", "{bad"))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['k'\]"):
        cli.speculative_config(parse("--speculative-config", '{"k": 3}'))
    with pytest.raises(ValueError, match="comma-separated"):
        cli.speculative_config(parse("--synthetic-acceptance-rates", "0.5;0.2"))


def test_bad_flag_value_is_one_clear_line(capsys):
    assert cli.main(["generate", "hi", "--num-speculative-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens must be an integer in [1, 32]" in err and "got 0" in err
    assert "Traceback" not in err


@requires_bundled
def test_bench_end_to_end(tmp_path, capsys):
    model = tmp_path / "model"
    save_tiny_model(model, "LlamaForCausalLM", vocab_size=49152)
    copy_bundled_tokenizer(str(model))
    out_json, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    status = cli.main([
        "bench", "--model", str(model), "--dtype", "float32", "--num-prompts", "2",
        "--max-tokens", "8", "--k-values", "1,2", "--prompt-lookup-min", "1",
        "--json", str(out_json), "--plot", str(plot),
    ])
    assert status == 0
    printed = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(printed[-1])["bench"]
    assert [r["k"] for r in rows] == [0, 1, 2]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["speedup"] > 0 and "mean_acceptance_length" in rows[1]
    for row in rows[1:]:  # the prediction counts the steps that drafted nothing
        assert 0 < row["draft_rate"] <= 1
        assert row["measured_over_predicted"] == pytest.approx(
            row["speedup"] / row["predicted_speedup"])
    assert any(line.startswith("method") for line in printed)
    assert json.loads(out_json.read_text()) == rows
    pytest.importorskip("matplotlib", reason="plotting needs the plot extra")
    assert plot.stat().st_size > 0


def test_synthetic_mode_warns_once_that_its_text_does_not_follow_the_model(tmp_path, capsys):
    """Issue 48: synthetic acceptance prints gibberish by design; the CLI (and the log) say so,
    once per process."""
    from verispec.engine import builder as builder_module

    logger = builder_module.logger
    logger.__dict__.pop("_verispec_warned", None)
    model = tmp_path / "model"
    save_tiny_model(model, "LlamaForCausalLM", vocab_size=49152)
    copy_bundled_tokenizer(str(model))
    for _ in range(2):
        assert cli.main(["generate", "hi", "--model", str(model), "--dtype", "float32",
                         "--max-tokens", "4", "--synthetic-acceptance-length", "2.0"]) == 0
    err = capsys.readouterr().err
    assert err.count("does not follow the model") == 1, err
