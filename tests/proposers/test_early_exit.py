"""Early-exit proposer.

Strategy: a tiny random 4-layer Llama (float32) as the target, in both cache designs: drafting in
the target ``ModelRunner``'s own rows, and an own N-layer cache over the target model. With N =
all layers the greedy drafts are the full model's greedy continuation; with N < layers they are
what a plain runner gives with ``num_layers=N`` token by token (and differ from the full model's,
so the layer cut is real). Over many simulated steps with random accept counts the drafts equal
those of a fresh proposer on the same committed context; with shared rows the target's lengths
are left as found and its logits are unchanged by drafting. Bad ``num_draft_layers`` errors.
"""

from __future__ import annotations

import pytest
import torch

from tests.proposers.test_draft_model import (
    MAX_MODEL_LEN,
    VOCAB,
    Request,
    check_rollback_over_steps,
    greedy_reference,
    save_llama,
    split,
)
from verispec.config import SpeculativeConfig
from verispec.models import load_model
from verispec.proposers import (
    EarlyExitProposer,
    ProposerContext,
    build_proposer,
    get_proposer_cls,
)
from verispec.runtime.model_runner import ModelRunner

NUM_LAYERS = 4
PROMPTS = [[1, 17, 5, 33, 8], [40, 2], [9, 9, 30]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_llama(tmp_path_factory.mktemp("target"), num_layers=NUM_LAYERS,
                                 seed=1))


def early_exit(target_model, num_layers, k: int = 4, method: str = "greedy") -> EarlyExitProposer:
    config = SpeculativeConfig(method="early_exit", num_speculative_tokens=k,
                               num_draft_layers=num_layers, draft_sample_method=method)
    context = ProposerContext(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB,
                              target_model=target_model)
    return build_proposer(config, context)


def target_model_for(mode: str, target):
    """What ProposerContext.target_model holds: the target's runner, or the model itself."""
    return ModelRunner(target.model, 4, MAX_MODEL_LEN) if mode == "runner" else target.model


def test_registered():
    assert get_proposer_cls("early_exit") is EarlyExitProposer


@pytest.mark.parametrize("mode", ["runner", "model"])
@pytest.mark.parametrize("num_layers", [NUM_LAYERS, 2])
def test_greedy_drafts_equal_first_layers_continuation(target, mode, num_layers):
    k = 4
    proposer = early_exit(target_model_for(mode, target), num_layers, k)
    assert proposer.shares_target_cache == (mode == "runner")
    requests = [Request(p, k, slot=s) for s, p in enumerate(PROMPTS)]
    drafts = split(proposer.propose(requests))
    for request, got in zip(requests, drafts):
        cut = None if num_layers == NUM_LAYERS else num_layers
        assert got == greedy_reference(target.model, request.token_ids, k, num_layers=cut)
    if num_layers < NUM_LAYERS:  # the first layers alone are a different (weaker) predictor
        full = [greedy_reference(target.model, p, k) for p in PROMPTS]
        assert drafts != full


def test_own_cache_holds_only_the_drafting_layers(target):
    proposer = early_exit(target.model, 2)
    cache = proposer.runner.kv_cache
    assert not proposer.shares_target_cache
    assert proposer.runner.model is target.model  # no second model
    blocks = 4 * -(-MAX_MODEL_LEN // cache.block_size) + 1  # 4 slots at full length + scratch
    assert cache.num_layers == 2 and cache.k.shape[:3] == (2, blocks, cache.block_size)
    # The dtype a runner picks for its cache (it may be wider than the model's).
    assert cache.k.dtype == ModelRunner(target.model, 1, 8).kv_cache.k.dtype
    assert early_exit(target, 2).runner.model is target.model  # a LoadedModel works too


def test_shared_rows_leave_the_target_as_found(target):
    """Drafting in the target's rows restores its lengths, and the target's next forward gives
    the same logits as on a runner that never drafted (its layers >= N rows and its live rows
    of layers < N are intact)."""
    runner = ModelRunner(target.model, 4, MAX_MODEL_LEN)
    reference = ModelRunner(target.model, 4, MAX_MODEL_LEN)
    proposer = early_exit(runner, 2)
    context = PROMPTS[0] + [3, 4]
    for r in (runner, reference):  # the target holds all committed tokens but the last
        r.forward([1], [context[:-1]], logits="none")
    # Slot 1 holds num_tokens - 1; slot 2 holds every committed token (its last one is fed
    # again through layers < N, then its length restored).
    runner.forward([2], [PROMPTS[2]], logits="none")
    reference.forward([2], [PROMPTS[2]], logits="none")
    proposer.propose([Request(context, 4, slot=1), Request(PROMPTS[2], 3, slot=2)])
    assert runner.kv_cache.lengths_np.tolist() == [0, len(context) - 1, len(PROMPTS[2]), 0]
    for r in (runner, reference):
        r.kv_cache.truncate(2, len(PROMPTS[2]) - 1)
    feeds = [[context[-1], 7, 8], [PROMPTS[2][-1], 5]]
    torch.testing.assert_close(runner.forward([1, 2], feeds, logits="all"),
                               reference.forward([1, 2], feeds, logits="all"))
    proposer.on_commit([1], [len(context) + 1])  # the engine owns the target's rollback
    proposer.free(1)
    assert runner.kv_cache.lengths_np.tolist() == [0, len(context) + 2, len(PROMPTS[2]) + 1, 0]


@pytest.mark.parametrize("mode", ["runner", "model"])
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_rollback_matches_fresh_proposer(target, mode, method):
    target_model = target_model_for(mode, target)
    check_rollback_over_steps(
        early_exit(target_model, 2, 3, method), early_exit(target.model, 2, 3, method), 3,
        seed=4, target_runner=target_model if mode == "runner" else None,
    )


def test_bad_num_draft_layers(target):
    for bad in (None, NUM_LAYERS + 1):
        with pytest.raises(ValueError, match=rf"num_draft_layers.*\[1, {NUM_LAYERS}\].*{bad}"):
            early_exit(target.model, bad)
    with pytest.raises(ValueError, match="num_draft_layers must be an integer >= 1"):
        early_exit(target.model, 0)
    for missing in (None, "model.gguf"):
        with pytest.raises(ValueError, match="target_model must be the target's ModelRunner"):
            early_exit(missing, 2)
