"""A padded CPU step whose requests feed very different numbers of tokens (decodes beside a
prefill chunk) runs as one forward per group of similar counts.

Strategy: exact equality. Batch invariance makes the grouped forward's logits ("last" and
"all"), its KV cache rows and the hidden states an EAGLE head reads those of the one padded
forward (grouping switched off), bit for bit; the grouping itself is checked on counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.utils import save_tiny_model
from verispec.models import load_model
from verispec.runtime import padded_layout
from verispec.runtime.model_runner import ModelRunner, padding_groups


def test_groups():
    assert [g.tolist() for g in padding_groups(np.array([1, 1, 1, 512]))] == [[0, 1, 2], [3]]
    assert [g.tolist() for g in padding_groups(np.array([4, 4, 3, 4]))] == [[0, 1, 2, 3]]
    groups = padding_groups(np.array([1, 300, 1, 512, 2]))
    assert [g.tolist() for g in groups] == [[0, 2, 4], [1, 3]]
    assert [g.tolist() for g in padding_groups(np.array([7]))] == [[0]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model(path, "LlamaForCausalLM")
    return load_model(str(path), "float32").model


def _step(model, logits, grouped, monkeypatch, capture_layers=()):
    """Prefill three requests, then one step of two decodes beside a 90-token chunk."""
    with monkeypatch.context() as patch:
        if not grouped:
            patch.setattr(padded_layout, "MAX_PADDING_RATIO", 1e9)
        runner = ModelRunner(model, 4, 256)
        runner.capture_layers = capture_layers
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, 100, size=n).tolist() for n in (9, 30, 4)]
        runner.forward([0, 1, 2], prompts, logits="none")
        tokens = [[5], rng.integers(1, 100, size=90).tolist(), [7]]
        out = runner.forward([0, 1, 2], tokens, logits=logits)
        cache = runner.kv_cache
        rows = []  # each slot's K/V rows in position order (the blocks may differ)
        for slot in range(3):
            length = int(cache.lengths_np[slot])
            index = torch.from_numpy(cache.block_tables.slot_mapping(
                np.full(length, slot), np.arange(length)))
            rows += [(k.flatten(0, 1)[index], v.flatten(0, 1)[index])
                     for k, v in zip(cache.k_layers, cache.v_layers)]
        return out, rows, runner.captured_hidden


@pytest.mark.parametrize("logits", ["last", "all"])
def test_grouped_forward_gives_the_padded_forwards_bits(model, logits, monkeypatch):
    captured_layers = (1, model.config.num_hidden_layers)
    out, cache, hidden = _step(model, logits, True, monkeypatch, captured_layers)
    want, want_cache, want_hidden = _step(model, logits, False, monkeypatch, captured_layers)
    assert out.shape[0] == (3 if logits == "last" else 92)
    assert torch.equal(out, want)
    for (k, v), (wk, wv) in zip(cache, want_cache):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    assert hidden.slots == want_hidden.slots
    assert np.array_equal(hidden.counts, want_hidden.counts)
    assert np.array_equal(hidden.row_start, want_hidden.row_start)
    assert torch.equal(hidden.rows, want_hidden.rows)
