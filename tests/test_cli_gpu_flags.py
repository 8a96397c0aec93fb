"""CLI: ``--enforce-eager``, token-id prompts for ``verispec bench`` and its up-front checks.

Strategy: runs on CPU, on a tiny random model directory as ``save_pretrained`` writes it (config
and safetensors, no tokenizer), the kind of directory a GPU benchmark is pointed at. The engine
flag is followed into the ``LLM`` that bench builds; ``--prompts random`` and a JSONL file of
token ids run end to end; text prompts on that model, and each bad bench flag, are one line on
stderr and exit status 2, the flags checked before any model is built.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.models.utils import save_tiny_model
from verispec import cli
from verispec.bench import run as bench


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> str:
    """A tiny Llama directory without tokenizer files (vocab 128)."""
    return save_tiny_model(tmp_path_factory.mktemp("bare") / "model", "LlamaForCausalLM")


@pytest.fixture
def built_llms(monkeypatch) -> list[dict]:
    """The keyword arguments of every LLM that ``verispec bench`` builds."""
    seen = []

    class RecordingLLM(bench.LLM):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bench, "LLM", RecordingLLM)
    return seen


def bench_args(model: str, *argv: str) -> list[str]:
    return ["bench", "--model", model, "--dtype", "float32", "--max-tokens", "4",
            "--prompt-lookup-min", "1", *argv]


def test_enforce_eager_flag_maps_onto_llm_argument():
    for command in (["generate", "hi"], ["bench"]):
        args = cli.build_parser().parse_args(command)
        assert cli.engine_kwargs(args)["enforce_eager"] is False
        args = cli.build_parser().parse_args([*command, "--enforce-eager"])
        assert cli.engine_kwargs(args)["enforce_eager"] is True


def test_help_shows_engine_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--enforce-eager" in out
    assert "keeps its quantised weights on the CPU; anything else bfloat16" in out
    assert "(default: cpu)" in out
    assert "(default: 256 on CUDA, 8 on CPU)" in out and "(default: 0.9)" in out


def test_bench_random_prompts_without_tokenizer(bare_model, built_llms, tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    status = cli.main(bench_args(bare_model, "--prompts", "random", "--num-prompts", "3",
                                 "--prompt-len", "5", "--batch-size", "2", "--k-values", "1,2",
                                 "--ignore-eos", "--enforce-eager", "--json", str(out_json)))
    assert status == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].split()[:2] == ["method", "k"]
    rows = json.loads(printed[-1])["bench"]
    assert [r["k"] for r in rows] == [0, 1, 2]
    assert all(r["tokens"] == 3 * 4 for r in rows)  # --ignore-eos: every prompt runs to 4 tokens
    assert json.loads(out_json.read_text()) == rows
    assert len(built_llms) == 3
    assert all(kw["enforce_eager"] is True and kw["device"] == "cpu" for kw in built_llms)


def test_bench_jsonl_token_ids_without_tokenizer(bare_model, tmp_path, capsys):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n"
                            for ids in ([5, 6, 7, 5, 6], [9, 10, 11, 12])))
    status = cli.main(bench_args(bare_model, "--prompts", str(path), "--k-values", "2"))
    assert status == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"]
    assert [r["k"] for r in rows] == [0, 2]


def test_bench_text_prompts_without_tokenizer_is_one_clear_error(bare_model, capsys):
    assert cli.main(bench_args(bare_model, "--num-prompts", "1")) == 2
    # the engine's start-up line (its KV cache), then the error alone
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("[verispec] KV cache:")]
    assert len(err) == 1
    assert "no tokenizer" in err[0] and "--prompts random" in err[0]
    assert "prompt_token_ids" in err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts must be an integer >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (["--prompt-len", "0"], "--prompt-len must be an integer >= 1, got 0"),
        (["--k-values", "a"], "--k-values must be comma-separated integers >= 1, got 'a'"),
        (["--k-values", "1,,3"], "--k-values must be comma-separated integers >= 1"),
        (["--k-values", "0"], "--k-values must be comma-separated integers >= 1, got '0'"),
        (["--json", "{tmp}/missing/rows.json"], "--json '{tmp}/missing/rows.json': the directory"),
        (["--json", "{tmp}"], "--json '{tmp}' is a directory"),
        (["--plot", "{tmp}/missing/plot.png"], "--plot '{tmp}/missing/plot.png': the directory"),
    ],
)
def test_bad_bench_flag_is_one_line_before_any_run(argv, message, tmp_path, monkeypatch,
                                                   capsys):
    def no_run(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(bench, "LLM", no_run)
    monkeypatch.setattr(bench, "run_bench", no_run)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["bench", "--prompts", "random", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert message.replace("{tmp}", str(tmp_path)) in err[0]


def test_plot_without_matplotlib_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    def no_run(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(bench, "run_bench", no_run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["bench", "--plot", str(tmp_path / "plot.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_batch_invariant_flag_maps_onto_llm_argument():
    parser = cli.build_parser()
    for command in ("generate", "bench"):
        prompt = ["hi"] if command == "generate" else []
        args = parser.parse_args([command, *prompt])
        assert cli.engine_kwargs(args)["batch_invariant"] is True
        args = parser.parse_args([command, *prompt, "--no-batch-invariant"])
        assert cli.engine_kwargs(args)["batch_invariant"] is False
