"""The ``verispec`` command line, end to end in subprocesses (as a user runs it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.models.utils import requires_bundled
from verispec import cli


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout


def test_flags_map_onto_fields():
    from verispec.cli import build_parser, engine_kwargs, sampling_params

    args = build_parser().parse_args(
        ["generate", "hi", "--dtype", "bfloat16", "--temperature", "0.5", "--top-k", "7",
         "--top-p", "0.9", "--seed", "3", "--max-tokens", "9", "--stop", "x", "--stop", "y"]
    )
    assert engine_kwargs(args)["dtype"] == "bfloat16"
    p = sampling_params(args)
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens) == (0.5, 7, 0.9, 3, 9)
    assert p.stop == ("x", "y")


def test_option_flags_map_onto_fields():
    from verispec.cli import build_parser, sampling_params

    p = sampling_params(build_parser().parse_args(
        ["generate", "hi", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
         "--frequency-penalty", "-0.5", "--min-tokens", "3", "--logit-bias", "5=2",
         "--logit-bias", "7=-100", "--allowed-token-ids", "5", "--allowed-token-ids", "7",
         "--bad-words", "foo", "--bad-words", "bar baz"]))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens) == (
        1.2, 0.5, -0.5, 3)
    assert p.logit_bias == {5: 2.0, 7: -100.0} and p.allowed_token_ids == (5, 7)
    assert p.bad_words == ("foo", "bar baz")
    p = sampling_params(build_parser().parse_args(["generate", "hi"]))
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert not p.uses_logits_options


def test_structured_outputs_flag_takes_a_json_object(capsys):
    from verispec.cli import build_parser, sampling_params

    p = sampling_params(build_parser().parse_args(
        ["generate", "hi", "--structured-outputs", '{"regex": "[0-9]+"}']))
    assert p.structured_outputs.regex == "[0-9]+"
    assert sampling_params(build_parser().parse_args(["generate", "hi"])).structured_outputs \
        is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--structured-outputs", "[1]"])
    assert "--structured-outputs takes a JSON object, got '[1]'" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--structured-outputs", '{"regex": ""}']) == 2
    err = capsys.readouterr().err
    assert "structured_outputs.regex" in err and "Traceback" not in err


def test_bad_option_flag_is_one_clear_error(capsys):
    assert cli.main(["generate", "hi", "--repetition-penalty", "0"]) == 2
    err = capsys.readouterr().err
    assert "repetition_penalty" in err and "Traceback" not in err


def test_bad_model_is_one_clear_error(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "not a local directory" in result.stderr
    assert "Traceback" not in result.stderr


@requires_bundled
@pytest.mark.slow
def test_generate_on_bundled_model():
    result = run_cli("generate", "Write a haiku about the sea.", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tokens/s" in result.stderr


def test_empty_prompt_and_ctrl_c_are_one_line(capsys, monkeypatch):
    """An empty prompt is refused before any model loads; Ctrl-C prints one line (exit 130),
    not a traceback."""
    assert cli.main(["generate", "  "]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the prompt is empty" in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "generate", (*cli.COMMANDS["generate"][:2], interrupted))
    assert cli.main(["generate", "hi"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err and err.strip().count("\n") == 0
