"""What a user of the command line sees (issue 26 item 5): every flag's default in ``--help``,
verispec's log lines (the ``SpecDecoding metrics`` line among them) on stderr by default, and
the CPU threads' OpenMP wait policy applied before torch starts its thread pool (item 4).

Strategy: help texts are read from the parsers; logging is checked in this process (a real
metrics logger) and, where import order matters, in fresh Python processes; ``generate`` runs
on a tiny random model with the bundled tokenizer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from verispec import cli
from verispec.engine.metrics import SpecDecodingLogger, SpecDecodingStats


def subcommand_parsers():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_shows_every_flags_default(command):
    parser = subcommand_parsers()[command]
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert "default" in (action.help or ""), f"{action.option_strings} shows no default"
    text = " ".join(parser.format_help().split())
    assert "--prompt-lookup-min PROMPT_LOOKUP_MIN (ngram; default: 5)" in text


def test_metrics_line_is_on_stderr_by_default(capsys):
    """The interval line a long speculative run logs reaches stderr with no logging set up."""
    logger = SpecDecodingLogger(2, interval_s=0.0)
    stats = SpecDecodingStats(2)
    stats.observe(2, 1)
    logger.observe(stats)
    line = logger.maybe_log()
    assert f"[verispec] {line}\n" in capsys.readouterr().err
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.00")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "VERISPEC_CONFIGURE_LOGGING",
                          "MALLOC_ARENA_MAX")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**clean, **env}, cwd=os.getcwd())


def test_logging_can_be_left_to_the_application():
    code = "import logging, verispec; print(len(logging.getLogger('verispec').handlers))"
    assert run_python(code).stdout.strip() == "1"
    assert run_python(code, VERISPEC_CONFIGURE_LOGGING="0").stdout.strip() == "0"


PARALLEL_OP = "import verispec, torch; torch.ones(1 << 20).sum()"


def test_openmp_wait_policy_is_passive_in_torchs_runtime():
    """``import verispec`` before torch: torch's OpenMP runtime (as it reports itself with
    OMP_DISPLAY_ENV) waits passively; a user's own choice is kept; torch imported first is too
    late to change, and verispec leaves it."""
    shown = run_python(PARALLEL_OP, OMP_DISPLAY_ENV="TRUE").stderr
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in shown
    shown = run_python(PARALLEL_OP, OMP_DISPLAY_ENV="TRUE", OMP_WAIT_POLICY="ACTIVE").stderr
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown
    late = run_python("import torch, os, verispec; print(os.environ.get('OMP_WAIT_POLICY'))")
    assert late.stdout.strip() == "None"


@requires_bundled
def test_generate_prints_the_metrics_line(tmp_path, capsys):
    path = save_tiny_model(tmp_path, "LlamaForCausalLM", vocab_size=49152)
    copy_bundled_tokenizer(path)
    status = cli.main(["generate", "Say hi", "--model", path, "--dtype", "float32",
                       "--max-tokens", "6", "--prompt-lookup-min", "1", "--ignore-eos"])
    assert status == 0
    err = capsys.readouterr().err
    assert "tokens/s" in err and "SpecDecoding metrics: Mean acceptance length:" in err


def test_train_draft_command_spins():
    """``verispec train-draft`` (a run that keeps every core busy) gets spinning workers; other
    commands, and programs that are not the verispec command, passive ones."""
    from verispec.cpu_threads import _policy

    assert _policy(["/usr/bin/verispec", "train-draft", "--output-dir", "x"]) == "ACTIVE"
    assert _policy(["verispec", "bench", "--prompts", "free"]) == "PASSIVE"
    assert _policy(["app.py", "train-draft"]) == "PASSIVE"
    assert _policy([]) == "PASSIVE"
    script = ("import sys; sys.argv = ['verispec', 'train-draft']; import verispec, torch; "
              "torch.ones(1 << 20).sum()")
    shown = run_python(script, OMP_DISPLAY_ENV="TRUE").stderr
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown


def test_one_heap_arena_unless_the_user_chose():
    """``import verispec`` asks glibc for one heap arena shared by every thread (what a CPU
    engine's threads free is then reused, not kept per thread); a ``MALLOC_ARENA_MAX`` the
    user set is kept."""
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        glibc = None
    if not glibc:
        pytest.skip("glibc only")
    script = "import verispec.cpu_threads as c; print(c.share_one_heap())"
    assert run_python(script).stdout.split() == ["True"]
    assert run_python(script, MALLOC_ARENA_MAX="4").stdout.split() == ["False"]
