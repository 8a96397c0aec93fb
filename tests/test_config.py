"""SpeculativeConfig validation and the synthetic-rate helpers.

Strategy: every rule of docs/design.md §3 gets a case with the message checked; the conversion and
schedule examples are reproduced literally.
"""

from __future__ import annotations

import pytest

from verispec import (
    SpeculativeConfig,
    acceptance_length_to_rates,
    unconditional_to_conditional_rates,
)


@pytest.mark.parametrize(
    ("length", "k", "expected"),
    [
        (2.6, 3, [1.0, 0.6, 0.0]),
        (1.0, 3, [0.0, 0.0, 0.0]),
        (4.0, 3, [1.0, 1.0, 1.0]),
        (3.5, 4, [1.0, 1.0, 0.5, 0.0]),
        (2, 1, [1.0]),
    ],
)
def test_length_to_rates_schedule(length, k, expected):
    assert acceptance_length_to_rates(length, k) == pytest.approx(expected, abs=1e-12)


def test_length_to_rates_out_of_range():
    with pytest.raises(ValueError, match=r"synthetic_acceptance_length .*\[1, 4\].*4\.5"):
        acceptance_length_to_rates(4.5, 3)
    with pytest.raises(ValueError, match=r"synthetic_acceptance_length .*0\.5"):
        acceptance_length_to_rates(0.5, 3)


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ([0.9, 0.5, 0.2], [0.9, 0.5 / 0.9, 0.2 / 0.5]),
        ([1.0, 0.6, 0.0, 0.0], [1.0, 0.6, 0.0, 0.0]),
        ([0.0, 0.0], [0.0, 0.0]),
        ([1.0, 1.0], [1.0, 1.0]),
    ],
)
def test_unconditional_to_conditional(rates, expected):
    assert unconditional_to_conditional_rates(rates) == pytest.approx(expected)


def test_defaults_and_prompt_lookup_mirroring():
    cfg = SpeculativeConfig()
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(prompt_lookup_min=2).prompt_lookup_max == 2
    assert SpeculativeConfig(prompt_lookup_max=7).prompt_lookup_min == 7
    cfg = SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 4)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens .*got 0"),
        ({"num_speculative_tokens": 2.5}, r"num_speculative_tokens .*got 2\.5"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min=4.*max=2"),
        ({"prompt_lookup_min": 0}, r"prompt_lookup_min .*got 0"),
        ({"rejection_sample_method": "fast"}, r"rejection_sample_method .*'fast'"),
        ({"draft_sample_method": "beam"}, r"draft_sample_method .*'beam'"),
        ({"method": ""}, r"method"),
    ],
)
def test_invalid_fields(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SpeculativeConfig(**kwargs)


def test_synthetic_needs_exactly_one_of_rates_and_length():
    for kwargs in ({}, {"synthetic_acceptance_rates": [0.5], "synthetic_acceptance_length": 1.5}):
        with pytest.raises(ValueError) as err:
            SpeculativeConfig(
                rejection_sample_method="synthetic", num_speculative_tokens=1, **kwargs
            )
        assert "synthetic_acceptance_rates" in str(err.value)
        assert "synthetic_acceptance_length" in str(err.value)


@pytest.mark.parametrize(
    ("rates", "pattern"),
    [
        ([0.5, 0.4], r"3 entries, got 2: \[0\.5, 0\.4\]"),
        ([0.5, 0.6, 0.1], r"non-increasing, got \[0\.5, 0\.6, 0\.1\]"),
        ([1.2, 0.5, 0.1], r"\[0, 1\], got \[1\.2, 0\.5, 0\.1\]"),
        ([0.5, -0.1, 0.0], r"\[0, 1\], got \[0\.5, -0\.1, 0\.0\]"),
    ],
)
def test_synthetic_rates_validation(rates, pattern):
    with pytest.raises(ValueError, match=pattern):
        SpeculativeConfig(
            rejection_sample_method="synthetic",
            num_speculative_tokens=3,
            synthetic_acceptance_rates=rates,
        )


def test_synthetic_length_out_of_range_quotes_value():
    with pytest.raises(ValueError, match=r"got 5\.5"):
        SpeculativeConfig(
            rejection_sample_method="synthetic",
            num_speculative_tokens=3,
            synthetic_acceptance_length=5.5,
        )


@pytest.mark.parametrize("field", ["synthetic_acceptance_rates", "synthetic_acceptance_length"])
def test_synthetic_fields_need_synthetic_method(field):
    value = [0.5] if field == "synthetic_acceptance_rates" else 1.5
    with pytest.raises(ValueError, match=rf"{field} .*rejection_sample_method='standard'"):
        SpeculativeConfig(num_speculative_tokens=1, **{field: value})


def test_synthetic_derived_rates():
    cfg = SpeculativeConfig(
        rejection_sample_method="synthetic",
        num_speculative_tokens=3,
        synthetic_acceptance_length=2.6,
    )
    assert cfg.unconditional_rates == pytest.approx((1.0, 0.6, 0.0))
    assert cfg.conditional_rates == pytest.approx([1.0, 0.6, 0.0])
    assert cfg.mean_acceptance_length == pytest.approx(2.6)
    cfg = SpeculativeConfig(
        rejection_sample_method="synthetic",
        num_speculative_tokens=3,
        synthetic_acceptance_rates=[0.9, 0.5, 0.2],
    )
    assert cfg.conditional_rates == pytest.approx([0.9, 0.5 / 0.9, 0.2 / 0.5])
    assert cfg.mean_acceptance_length == pytest.approx(2.6)


def test_from_dict_accepts_vllm_keys_and_rejects_unknown():
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}
    )
    assert cfg.num_speculative_tokens == 4 and cfg.prompt_lookup_min == 2
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_spec_tokens'\]"):
        SpeculativeConfig.from_dict({"num_spec_tokens": 3})
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg


def test_num_speculative_tokens_has_a_sane_cap():
    """Regression: k = 1000 was accepted and allocated a k x V buffer per slot."""
    from verispec.config import MAX_SPECULATIVE_TOKENS

    SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in"):
        SpeculativeConfig(num_speculative_tokens=1000)


@pytest.mark.parametrize("method, key, value", [
    ("ngram", "model", "some/dir"),
    ("ngram", "draft_sample_method", "probabilistic"),
    ("ngram", "num_draft_layers", 4),
    ("draft_model", "prompt_lookup_max", 3),
    ("early_exit", "model", "some/dir"),
])
def test_keys_the_method_does_not_use_are_refused(method, key, value):
    """Regression: ``model`` with ``ngram`` was silently ignored."""
    with pytest.raises(ValueError, match=f"{method!r} does not use {key}="):
        SpeculativeConfig(method=method, **{key: value})


def test_speculative_token_tree_in_vllm_format():
    """vLLM's string or list form; the depth must be num_speculative_tokens; the parents follow
    the paths (docs/design.md §16); a dict round-trips."""
    config = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2,
                               speculative_token_tree="[(0,), (1,), (0, 0), (0, 1)]")
    assert config.speculative_token_tree == ((0,), (1,), (0, 0), (0, 1))
    assert config.tree_parents == [-1, -1, 0, 0]
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    assert SpeculativeConfig(method="draft_model", model="d").tree_parents is None


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(speculative_token_tree=[(0,), (0, 0)], num_speculative_tokens=3),
     "depth 2; num_speculative_tokens must equal it"),
    (dict(speculative_token_tree="[(0,), (0, 1)]", num_speculative_tokens=2),
     r"path \(0, 1\) should end in 0"),
    (dict(speculative_token_tree="[(0,), oops]"), "list of tuples"),
    (dict(speculative_token_tree=[]), "at least one path"),
    (dict(speculative_token_tree=[(0,)], num_speculative_tokens=1,
          rejection_sample_method="synthetic", synthetic_acceptance_length=1.5),
     "not rejection_sample_method='synthetic'"),
])
def test_bad_token_trees_are_refused(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SpeculativeConfig(method="draft_model", model="d", **kwargs)


def test_token_tree_refused_by_ngram():
    with pytest.raises(ValueError, match="'ngram' does not use speculative_token_tree="):
        SpeculativeConfig(method="ngram", speculative_token_tree=[(0,)], num_speculative_tokens=1)
