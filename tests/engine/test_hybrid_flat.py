"""A hybrid (Mamba2 + attention) model on the GPU path's flat layout, checked on the CPU with the
torch twins (``flat_layout=True``; the captured steps run eagerly on the same static buffers).

Strategy: the flat runner must give the CPU path's logits, lengths and recurrent states for
prefills in both forms (recurrent and chunked scan), decode and verify steps, including a batch
padded up to its bucket and requests feeding fewer tokens than the step's width (their padding
tokens must leave every state alone, the padding rows write only the scratch slot). Then through
the whole engine, token for token in float32: the flat path equals the CPU path; greedy
speculation (n-gram, early exit) equals plain greedy over a draft schedule that mixes steps with
every draft accepted, some rejected and none after accepted ones; synthetic speculation (which
accepts drafts the target disagrees with, so the states must continue from exactly the accepted
positions) gives the CPU path's tokens and the configured acceptance length; a request alone
equals the same request in a batch (another bucket), greedy and seeded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_hybrid_spec import (
    MAX_MODEL_LEN,
    PROMPTS,
    VOCAB,
    engine,
    follow_schedule,
    spec_config,
)
from tests.models.test_granite_hybrid import (
    one_thread,  # noqa: F401 (autouse fixture)
    save_hybrid,
)
from tests.proposers.test_draft_model import save_llama
from verispec import SamplingParams
from verispec.engine import builder as builder_module
from verispec.models.loader import load_model
from verispec.models.mamba2 import MAX_RECURRENT_TOKENS
from verispec.proposers import draft_model as draft_model_module
from verispec.proposers import eagle as eagle_module
from verispec.runtime.model_runner import ModelRunner


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hybrid(tmp_path_factory.mktemp("hybrid_flat_target"))


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """A Llama draft and a hybrid draft (test_hybrid_spec's)."""
    return (save_llama(tmp_path_factory.mktemp("llama_draft"), num_layers=1, seed=1,
                       vocab_size=VOCAB),
            save_hybrid(tmp_path_factory.mktemp("hybrid_draft"),
                        layer_types=("mamba", "attention"), seed=1))


@pytest.fixture(scope="module")
def model(target_dir):
    return load_model(target_dir).model


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    assert err <= 1e-5 * max(1.0, b.abs().max().item()), err


def _live_states(runner: ModelRunner, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each Mamba2 layer's conv and SSM state after the slot's committed tokens."""
    cache = runner.kv_cache
    entry = (slot, cache.length(slot) % cache.ring_size)
    return [(s.conv[entry], s.ssm[entry]) for s in cache.states]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_flat_layout_matches_cpu_path(model, enforce_eager):
    reference = ModelRunner(model, 4, MAX_MODEL_LEN, max_step_tokens=4)
    flat = ModelRunner(model, 4, MAX_MODEL_LEN, flat_layout=True, max_step_tokens=4,
                       enforce_eager=enforce_eager)
    flat.capture([1, 4])
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(3, 16, size=MAX_RECURRENT_TOKENS + 12).tolist()  # chunked scan
    prompts = [[5, 7, 3, 9, 11, 2, 4], [3, 4], long_prompt]
    slots = [2, 0, 1]
    _close(flat.forward(slots, prompts, logits="all"),
           reference.forward(slots, prompts, logits="all"))
    # decode; verify of 1 + 2, 1 + 0 and 1 + 1 tokens (padded to 4 in the graph); a rollback
    # to each request's first verified position; decode from there
    steps = [[[4], [9], [12]], [[4, 8, 15], [6], [3, 2]], [[1], [2], [3]]]
    for tokens in steps:
        _close(flat.forward(slots, tokens, logits="all"),
               reference.forward(slots, tokens, logits="all"))
    for runner in (reference, flat):
        for slot, back in zip(slots, (2, 0, 1)):
            runner.kv_cache.truncate(slot, runner.kv_cache.length(slot) - back)
    _close(flat.forward(slots, [[5], [6], [7]]), reference.forward(slots, [[5], [6], [7]]))
    assert flat.kv_cache.lengths_np.tolist() == reference.kv_cache.lengths_np.tolist()
    for slot in slots:
        for (conv_a, ssm_a), (conv_b, ssm_b) in zip(_live_states(flat, slot),
                                                    _live_states(reference, slot)):
            _close(conv_a, conv_b)
            _close(ssm_a, ssm_b)


def test_padding_tokens_and_rows_leave_states_alone(model):
    """A verify step of 1 + 0 drafts replays the 4-token graph (3 padding tokens) in bucket 4
    of a batch of 3 (one padding row): only the ring entries of the real tokens change, and the
    free slot's states are never written (the padding row used the scratch slot)."""
    flat = ModelRunner(model, 4, MAX_MODEL_LEN, flat_layout=True, max_step_tokens=4)
    flat.capture([4])
    slots = [2, 0, 1]
    flat.forward(slots, [[5, 7, 3], [3, 4], [9, 9, 9, 2]], logits="none")
    states = flat.kv_cache.states
    before = [(s.conv.clone(), s.ssm.clone()) for s in states]
    lengths = flat.kv_cache.lengths_np.copy()
    assert flat._graph_for(3, 2, None) == 4  # the step below replays the 4-token graph
    flat.forward(slots, [[4, 8], [6, 1], [3]], logits="all")  # 2, 2 and 1 real tokens
    ring = flat.kv_cache.ring_size
    for state, (conv, ssm) in zip(states, before):
        for name, now, was in (("conv", state.conv, conv), ("ssm", state.ssm, ssm)):
            changed = (now != was).flatten(2).any(-1)  # [slots + 1, ring]
            expected = torch.zeros_like(changed)
            for slot, count in zip(slots, (2, 2, 1)):
                for length in range(lengths[slot] + 1, lengths[slot] + count + 1):
                    expected[slot, length % ring] = True
            assert torch.equal(changed[:4], expected[:4]), name
    assert flat.kv_cache.scratch_slot == 4 and states[0].scratch_slot == 4


def _greedy(llm, prompts=PROMPTS, max_tokens=40) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


class _FlatRunner(ModelRunner):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("flat_layout", True)
        super().__init__(*args, **kwargs)


@pytest.fixture
def flat_engine(monkeypatch):
    """``engine`` with every runner (the target's, a draft model's) on the flat layout."""
    def make(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(builder_module, "ModelRunner", _FlatRunner)
            patch.setattr(draft_model_module, "ModelRunner", _FlatRunner)
            patch.setattr(eagle_module, "ModelRunner", _FlatRunner)
            llm = engine(*args, **kwargs)
        assert llm.runner.flat and llm.runner.graphs is not None
        return llm
    return make


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    return _greedy(engine(target_dir))


def test_flat_greedy_equals_cpu_path(target_dir, flat_engine, plain_greedy):
    assert _greedy(flat_engine(target_dir, max_num_seqs=3)) == plain_greedy


@pytest.mark.parametrize("name", ["ngram", "early_exit_1", "early_exit_all",
                                  "hybrid_draft_model", "draft_model_probabilistic"])
def test_flat_greedy_speculative_equals_plain(name, target_dir, draft_dirs, flat_engine,
                                              plain_greedy):
    """Early exit drafts through the target's captured draft step (its first layers' states
    rolled back with the target's), a draft model through its own (a hybrid one: its own
    state ring, drafting ahead of the host)."""
    llm = flat_engine(target_dir, spec_config(name, *draft_dirs), max_num_seqs=3)
    proposer_runner = getattr(llm.spec.proposer, "runner", None)
    assert proposer_runner is None or proposer_runner.flat
    events = follow_schedule(llm)
    assert _greedy(llm) == plain_greedy
    assert any(n > 0 and a == n for _, n, a in events)  # every draft accepted
    if name == "early_exit_all":  # the target's own continuation: never rejected
        return
    assert any(n > 0 and a < n for _, n, a in events)  # some rejected
    last: dict[int, int] = {}
    zero_after_accepted = 0
    for rid, n, a in events:
        zero_after_accepted += n == 0 and last.get(rid, 0) > 0
        last[rid] = a
    assert zero_after_accepted > 0


def test_flat_synthetic_speculation_equals_cpu_path(target_dir, flat_engine):
    """Synthetic acceptance commits drafts whatever the target says: the next step must start
    from the state after exactly those tokens, on both paths alike."""
    spec = {"method": "early_exit", "num_draft_layers": 1, "num_speculative_tokens": 3,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=48,
                             ignore_eos=True) for i in range(4)]
    prompts = PROMPTS[:4]
    cpu = engine(target_dir, spec, max_num_seqs=4)
    flat = flat_engine(target_dir, spec, max_num_seqs=4)
    outs = [[o.token_ids for o in llm.generate(prompts, params)] for llm in (cpu, flat)]
    assert outs[1] == outs[0]
    metrics = flat.get_metrics()["spec_decoding"]
    assert metrics["num_drafts"] >= 40
    assert metrics["mean_acceptance_length"] == pytest.approx(2.5, abs=0.3)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.9, seed=7)])
def test_flat_request_alone_equals_request_in_a_batch(target_dir, flat_engine, params):
    llm = flat_engine(target_dir, spec_config("ngram", ""), max_num_seqs=8)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True, **params)
    alone = llm.generate(PROMPTS[0], sampling)[0].token_ids
    batch = [PROMPTS[0]] + [p for p in PROMPTS[1:] for _ in range(2)][:6]  # 7: bucket 8
    assert llm.generate(batch, sampling)[0].token_ids == alone


@pytest.mark.parametrize("flat_layout", [False, True])
def test_long_prefill_keeps_the_state_before_its_last_token(model, flat_layout):
    """A chunked-scan prefill keeps the states after its last two tokens: rolled back by one
    (a captured draft re-feeds the last committed token from there), it continues exactly as
    the straight run."""
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 16, size=MAX_RECURRENT_TOKENS + 20).tolist()
    n = MAX_RECURRENT_TOKENS + 8
    runner = ModelRunner(model, 2, MAX_MODEL_LEN, flat_layout=flat_layout, max_step_tokens=4,
                         enforce_eager=True)
    runner.forward([0], [ids[:n]], logits="none")
    straight = runner.forward([0], [ids[n:n + 4]], logits="all")
    runner.forward([1], [ids[:n]], logits="none")
    runner.kv_cache.truncate(1, n - 1)
    again = runner.forward([1], [ids[n - 1:n + 4]], logits="all")
    assert torch.equal(again[1:], straight)
    runner.kv_cache.free(1)
    runner.forward([1], [ids[:n]], logits="none")
    with pytest.raises(ValueError, match="recurrent state is kept"):
        runner.kv_cache.truncate(1, n - 2)


def test_triton_ops_match_the_torch_twins(tmp_path):
    """The flat path with the GPU's ops (Triton model ops and the Triton SSM state update, in
    the interpreter on CPU): the twins' logits and states, for a prefill of a short and a long
    prompt, then a verify step replayed with padding tokens and a padding row."""
    from tests.engine.test_hybrid_gpu import save_hybrid_gpu
    from verispec.ops.model_ops import triton_model_ops

    gpu_model = load_model(save_hybrid_gpu(tmp_path), "float32").model
    runners = [ModelRunner(gpu_model, 4, 128, flat_layout=True, max_step_tokens=4)
               for _ in range(2)]
    runners[1].ops = triton_model_ops(True)
    assert runners[1].model is runners[0].model
    slots = [2, 0, 1]
    steps = [[[5, 7, 3, 9, 11], [3, 4], [(7 * j) % 512 for j in range(MAX_RECURRENT_TOKENS + 4)]],
             [[4, 8, 15], [6], [3, 2]]]
    for r in runners:
        r.capture([4])
    for tokens in steps:
        _close(*(r.forward(slots, tokens, logits="all") for r in reversed(runners)))
    for a, b in zip(runners[1].kv_cache.states, runners[0].kv_cache.states):
        _close(a.ssm[:4], b.ssm[:4])
        _close(a.conv[:4], b.conv[:4])


def test_token_trees_are_refused(target_dir, draft_dirs, flat_engine):
    """A hybrid target's recurrent state cannot branch: token trees are refused on the flat
    layout as on the CPU path, naming the field."""
    spec = {"method": "draft_model", "model": draft_dirs[0], "num_speculative_tokens": 2,
            "speculative_token_tree": [(0,), (1,), (0, 0)]}
    with pytest.raises(ValueError, match="speculative_token_tree: .*attention-only target"):
        flat_engine(target_dir, spec)
