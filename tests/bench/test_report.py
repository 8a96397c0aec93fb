"""Benchmark helpers: prompt sets, JSONL loading, random token-id prompts, the preparation of
prompts for a model, the Leviathan prediction, the acceptance estimate, the table, the plot and
the progress bar.

Strategy: closed forms checked against the formulas of docs/design.md §10 on a grid (and exactly at
alpha = 0 and 1), the estimate checked to recover alpha from geometric rates and from the
counters of simulated geometric acceptance through ``SpecDecodingStats``; loaders fed good and
bad files; prompt preparation run against stand-in models (with and without a tokenizer or a
chat template); the table compared as text; the plot written to a PNG and read back.
"""

from __future__ import annotations

import io
import json
import math
import random
from types import SimpleNamespace

import pytest

from verispec.bench import report as bench_utils
from verispec.bench.report import (
    FREE_PROMPTS,
    GROUNDED_PROMPTS,
    RandomPrompts,
    estimate_acceptance_rate,
    expected_speedup,
    expected_tokens_per_step,
    format_table,
    get_prompts,
    leviathan_prediction,
    load_jsonl_prompts,
    machine_description,
    plot_acceptance_and_speedup,
    print_table,
    progress,
    prompt_set_names,
)
from verispec.bench.run import prepare_prompts
from verispec.engine.metrics import SpecDecodingStats

# --- prompt sets ---


def test_builtin_prompt_sets():
    assert prompt_set_names() == ["free", "grounded"]
    assert len(GROUNDED_PROMPTS) >= 8 and len(FREE_PROMPTS) >= 8
    for prompts in (GROUNDED_PROMPTS, FREE_PROMPTS):
        assert len(set(prompts)) == len(prompts)
        assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert get_prompts("grounded") == list(GROUNDED_PROMPTS)
    assert get_prompts("free") == list(FREE_PROMPTS)


def test_grounded_prompts_carry_the_text_to_reuse():
    code = [p for p in GROUNDED_PROMPTS if "def " in p or "function " in p or "class " in p]
    texts = [p for p in GROUNDED_PROMPTS if p.startswith(("Summarise", "List", "Rewrite"))]
    assert len(code) >= 4 and len(texts) >= 3
    assert any("docstring" in p and "return the code" in p for p in code)
    assert all(len(p) > 200 for p in code + texts)  # the input is in the prompt
    assert all(len(p) < 200 for p in FREE_PROMPTS)


def test_jsonl_loading(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "first", "id": 1}) + "\n\n"
        + json.dumps({"prompt": "second ünïcode"}) + "\n",
        encoding="utf-8",
    )
    assert load_jsonl_prompts(path) == ["first", "second ünïcode"]
    assert get_prompts(str(path)) == ["first", "second ünïcode"]
    assert get_prompts(path) == ["first", "second ünïcode"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "ok"', "not valid JSON"),
        ('["a list"]', 'expected an object with a non-empty "prompt" string'),
        ('{"text": "no prompt key"}', '"prompt"'),
        ('{"prompt": 3}', '"prompt"'),
        ('{"prompt": ""}', '"prompt"'),
        ('{"prompt_token_ids": []}', '"prompt_token_ids" list of integers >= 0'),
        ('{"prompt_token_ids": [1, -2]}', '"prompt_token_ids"'),
        ('{"prompt_token_ids": [1, true]}', '"prompt_token_ids"'),
        ('{"prompt_token_ids": "1 2"}', '"prompt_token_ids"'),
        ('{"prompt": "a", "prompt_token_ids": [1]}', r"\(not both\)"),
    ],
)
def test_jsonl_bad_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        load_jsonl_prompts(path)


def test_jsonl_empty_file_and_unknown_source(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="no prompts"):
        load_jsonl_prompts(path)
    with pytest.raises(ValueError, match=r"built-in set \['free', 'grounded'\].*'nothing\.jsonl'"):
        get_prompts("nothing.jsonl")


def test_jsonl_token_id_prompts(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"prompt_token_ids": [3, 1, 4], "id": 7}\n{"prompt": "text"}\n',
                    encoding="utf-8")
    assert load_jsonl_prompts(path) == [[3, 1, 4], "text"]


# --- random token-id prompts ---


def test_random_prompts_are_seeded_and_in_the_vocabulary():
    prompts = RandomPrompts(num_prompts=4, prompt_len=6).token_ids(50)
    assert len(prompts) == 4 and all(len(p) == 6 for p in prompts)
    assert all(isinstance(t, int) and 0 <= t < 50 for p in prompts for t in p)
    assert prompts == RandomPrompts(num_prompts=4, prompt_len=6).token_ids(50)
    assert prompts != RandomPrompts(num_prompts=4, prompt_len=6, seed=1).token_ids(50)
    assert len({t for p in RandomPrompts(8, 64).token_ids(50) for t in p}) == 50  # all ids reached


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_prompts": 0}, "num_prompts must be an integer >= 1, got 0"),
     ({"prompt_len": 2.5}, "prompt_len must be an integer >= 1, got 2.5"),
     ({"seed": "x"}, "seed must be an integer")],
)
def test_random_prompts_check_their_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RandomPrompts(**kwargs)


# --- prompts prepared for a model ---


class _ChatTokenizer:
    """Stands in for an HF tokenizer: one id per character, a chat template of tags."""

    def __init__(self, chat_template):
        self.chat_template = chat_template

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _model(tokenizer=None, vocab_size=100, max_model_len=64):
    """The attributes of an ``LLM`` that ``prepare_prompts`` reads."""
    return SimpleNamespace(tokenizer=tokenizer, max_model_len=max_model_len,
                           model_config=SimpleNamespace(vocab_size=vocab_size))


def test_prepare_prompts_draws_random_ids_from_the_model_vocabulary():
    prompts = prepare_prompts(_model(vocab_size=7), RandomPrompts(3, 5), chat=True)
    assert prompts == RandomPrompts(3, 5).token_ids(7)


def test_prepare_prompts_wraps_text_as_chat_only_with_a_template():
    with_template = _model(_ChatTokenizer("{{ messages }}"))
    assert prepare_prompts(with_template, ["hi", [1, 2]], chat=True) == [
        [{"role": "user", "content": "hi"}], [1, 2]]
    assert prepare_prompts(with_template, ["hi"], chat=False) == ["hi"]
    assert prepare_prompts(_model(_ChatTokenizer(None)), ["hi"], chat=True) == ["hi"]


@pytest.mark.parametrize(
    ("model", "prompts", "message"),
    [
        (_model(), ["text", [1, 2]], "no tokenizer.*--prompts random.*prompt_token_ids"),
        (_model(), [[1, 2], [3, 100]], r"prompt 1: .*token ids must be integers in \[0, 100\)"),
        (_model(max_model_len=4), [[1, 2, 3, 4]], "prompt 0 has 4 tokens, but max_model_len=4"),
        (_model(), [], "no prompts"),
    ],
)
def test_prepare_prompts_refuses_what_the_model_cannot_take(model, prompts, message):
    with pytest.raises(ValueError, match=message):
        prepare_prompts(model, prompts, chat=True)


# --- Leviathan prediction ---


def test_expected_tokens_per_step_closed_form():
    for k in range(0, 8):
        for alpha in (0.0, 0.1, 0.5, 0.9, 0.999, 1.0):
            closed = k + 1 if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
            assert expected_tokens_per_step(alpha, k) == pytest.approx(closed, rel=1e-12)
    assert expected_tokens_per_step(1.0, 4) == 5.0  # exact, no 0 / 0
    assert expected_tokens_per_step(1, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.7, 0) == 1.0
    # Near 1 the closed form cancels; the series stays accurate and below k + 1.
    assert 3.99 < expected_tokens_per_step(1 - 1e-12, 3) <= 4.0
    assert expected_tokens_per_step(1 - 1e-12, 3) == pytest.approx(4.0, abs=1e-10)


def test_expected_speedup_closed_form():
    for k in (1, 3, 5):
        for alpha in (0.0, 0.6, 0.8, 1.0):
            for c in (0.0, 0.05, 0.5):
                tokens = k + 1 if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
                assert expected_speedup(alpha, k, c) == pytest.approx(tokens / (k * c + 1))
    # alpha = 0.8, k = 4, c = 0.05: 3.3616 tokens per step for 1.2 steps of cost, 2.80x.
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert expected_speedup(1.0, 3, 0.0) == 4.0
    assert expected_speedup(0.8, 3, 0.0, verify_cost=2.0) == pytest.approx(2.952 / 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1.2, 3, 0.0), "alpha must be in"),
        ((-0.1, 3, 0.0), "alpha must be in"),
        ((math.nan, 3, 0.0), "alpha must be in"),
        ((0.5, -1, 0.0), "k must be an integer"),
        ((0.5, 2.0, 0.0), "k must be an integer"),
        ((0.5, 2, -0.1), "c must be"),
        ((0.5, 2, math.nan), "c must be"),
    ],
)
def test_prediction_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        expected_speedup(*args)
    with pytest.raises(ValueError, match="verify_cost must be"):
        expected_speedup(0.5, 2, 0.1, verify_cost=-1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        expected_speedup(0.5, 0, 0.1, verify_cost=0.0)


def test_estimate_recovers_geometric_alpha():
    for alpha in (0.0, 0.3, 0.75, 1.0):
        for k in (1, 3, 6):
            rates = [alpha**i for i in range(1, k + 1)]
            assert estimate_acceptance_rate(rates) == pytest.approx(alpha, abs=1e-12)
    # (L - 1) / (L - a_k) form.
    rates = [0.9, 0.5, 0.2]
    length = 1 + sum(rates)
    assert estimate_acceptance_rate(rates) == pytest.approx((length - 1) / (length - rates[-1]))
    with pytest.raises(ValueError, match="at least one"):
        estimate_acceptance_rate([])
    with pytest.raises(ValueError, match="must lie in"):
        estimate_acceptance_rate([1.5, 0.2])


def test_estimate_from_simulated_engine_counters():
    """Geometric acceptance (alpha = 0.7, k = 4) observed through SpecDecodingStats."""
    rng = random.Random(5)
    alpha, k = 0.7, 4
    stats = SpecDecodingStats(k)
    for _ in range(20000):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        stats.observe(k, accepted)
    estimate = estimate_acceptance_rate(stats.acceptance_rate_per_pos)
    assert estimate == pytest.approx(alpha, abs=0.01)
    prediction = leviathan_prediction(stats.acceptance_rate_per_pos, c=0.0)
    assert prediction["alpha"] == estimate
    # The prediction matches the measured mean acceptance length (tokens per step).
    assert prediction["predicted_tokens_per_step"] == pytest.approx(
        stats.mean_acceptance_length, rel=0.02
    )
    assert prediction["predicted_speedup"] == pytest.approx(
        prediction["predicted_tokens_per_step"]
    )


# --- table, plot, progress ---


def test_format_table():
    rows = [
        {"method": "none", "k": 0, "tokens/s": 30.126, "speedup": 1.0},
        {"method": "ngram", "k": 3, "tokens/s": 91.2, "speedup": 3.03,
         "acceptance_rate_per_pos": [0.8, 0.6, 0.4]},
    ]
    assert format_table(rows).splitlines() == [
        "method  k  tokens/s  speedup  acceptance_rate_per_pos",
        "------  -  --------  -------  -----------------------",
        "none    0     30.13     1.00",
        "ngram   3     91.20     3.03  0.80, 0.60, 0.40",
    ]
    assert format_table(rows, columns=["speedup", "method"], float_format=".1f").splitlines() == [
        "speedup  method",
        "-------  ------",
        "    1.0  none",
        "    3.0  ngram",
    ]
    assert format_table([], columns=["a", "b"]).splitlines() == ["a  b", "-  -"]
    out = io.StringIO()
    print_table(rows, file=out)
    assert out.getvalue() == format_table(rows) + "\n"


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (extra 'plot')")
    rows = [{"label": "none", "k": 0, "speedup": 1.0}]
    for label, alpha in (("ngram / grounded", 0.8), ("ngram / free", 0.3)):
        for k in (1, 3, 5):
            rates = [alpha**i for i in range(1, k + 1)]
            rows.append({
                "label": label, "k": k, "acceptance_rate_per_pos": rates,
                "speedup": 0.9 * expected_speedup(alpha, k, 0.02),
                "predicted_speedup": expected_speedup(alpha, k, 0.02),
            })
    path = tmp_path / "spec.png"
    plot_acceptance_and_speedup(rows, path, title="test")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_acceptance_and_speedup([], tmp_path / "empty.png")


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"verispec\[plot\]"):
        plot_acceptance_and_speedup([{"k": 1, "speedup": 1.0}], tmp_path / "x.png")


def test_progress_bar():
    out = io.StringIO()
    items = list(progress(range(5), desc="ngram k=3", unit="prompt", disable=False, file=out))
    assert items == [0, 1, 2, 3, 4]
    assert "ngram k=3" in out.getvalue()
    silent = io.StringIO()
    bar = progress(total=10, unit="tok", disable=True, file=silent)
    bar.update(10)
    bar.close()
    assert silent.getvalue() == ""


def test_machine_description():
    line = machine_description()
    assert "cores" in line and "torch" in line
    assert bench_utils.machine_description is machine_description


def test_prediction_counts_steps_without_drafts_as_plain_steps():
    """Issue 48: an n-gram proposer drafts in only some steps; the prediction must not assume
    every step drafted (1.84x predicted vs 1.11x measured on grounded, k=1)."""
    rates = [0.8, 0.6, 0.4]
    every = leviathan_prediction(rates, c=0.01, verify_cost=1.1)
    assert leviathan_prediction(rates, 0.01, 1.1, draft_rate=1.0) == dict(every, draft_rate=1.0)
    half = leviathan_prediction(rates, c=0.01, verify_cost=1.1, draft_rate=0.5)
    tokens = 0.5 * every["predicted_tokens_per_step"] + 0.5
    assert half["predicted_tokens_per_step"] == pytest.approx(tokens)
    assert half["predicted_speedup"] == pytest.approx(tokens / (3 * 0.01 + 1.1))
    with pytest.raises(ValueError, match="draft_rate must be in"):
        leviathan_prediction(rates, 0.0, draft_rate=1.5)


def test_draft_rate_from_the_counters():
    from verispec.bench.run import _Measured, draft_rate

    stats = SpecDecodingStats(3)
    stats.observe(3, 2)  # a drafted step: 3 tokens
    stats.observe(2, 0)  # a drafted step: 1 token
    # 2 requests: 2 prefill tokens + 4 from the drafted steps + 4 plain steps = 10 tokens
    measured = _Measured(num_tokens=10, num_requests=2, stats=stats)
    assert draft_rate(measured) == pytest.approx(2 / 6)
