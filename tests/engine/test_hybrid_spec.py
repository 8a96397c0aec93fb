"""Speculative decoding on a hybrid (Mamba2 + attention) target, through the whole engine.

Strategy: a tiny random GraniteMoeHybrid target (3 Mamba2 layers around one attention layer) and
properties that hold for any weights only if the recurrent state is rolled back right
(docs/design.md §6: the next step continues from the state after its last accepted position).
- Greedy: speculative output == plain output, token for token, for every proposer (n-gram, a
  Llama draft model with greedy and probabilistic drafts, a hybrid draft model, early exit
  through the first layer and through every layer, the latter accepting every draft), in
  float32 and (n-gram, early exit) bfloat16. The number of drafts per step follows a fixed
  schedule that puts steps with zero drafts right after steps with drafts (vLLM corrupted the
  state there); the test checks that the runs really held steps with all drafts accepted, with
  some rejected, and with zero drafts after accepted ones.
- Early exit's rollback over random accept counts equals a fresh proposer's drafts, drafting in
  the target's rows (whose first N layers' states it advances) or in an own N-layer cache.
- Sampling: the first six tokens of seeded sampled requests with speculation (early exit and
  draft model, probabilistic drafts) against the plain engine, by a two-sample chi-square per
  position (p >= 1e-6); a cache keeping one state per slot (no rollback) must fail it.
- Continuous batching: requests of different lengths (chunked and recurrent prefills) joining
  and leaving a batch of 3 slots give exactly the tokens each gives alone.
- Synthetic mode measures the configured mean acceptance length on a hybrid target.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_spec_decode import _two_sample_p
from tests.models.test_granite_hybrid import (
    one_thread,  # noqa: F401 (autouse fixture)
    save_hybrid,
)
from tests.proposers.test_draft_model import save_llama
from verispec import LLM, SamplingParams

VOCAB = 16
K = 3
MAX_MODEL_LEN = 128
P_VALUE_THRESHOLD = 1e-6
# Drafts per step (cut to what fits): steps with zero drafts follow steps with drafts.
DRAFT_SCHEDULE = (3, 3, 0, 2, 0, 0, 3, 1, 3, 0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hybrid(tmp_path_factory.mktemp("hybrid_target"))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama_draft"), num_layers=1, seed=1,
                      vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hybrid_draft_dir(tmp_path_factory):
    return save_hybrid(tmp_path_factory.mktemp("hybrid_draft"), layer_types=("mamba", "attention"),
                       seed=1)


def spec_config(name: str, draft_dir: str, hybrid_draft_dir: str | None = None) -> dict:
    return {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model_greedy": {"method": "draft_model", "model": draft_dir},
        "draft_model_probabilistic": {"method": "draft_model", "model": draft_dir,
                                      "draft_sample_method": "probabilistic"},
        "hybrid_draft_model": {"method": "draft_model", "model": hybrid_draft_dir},
        "early_exit_1": {"method": "early_exit", "num_draft_layers": 1},
        "early_exit_all": {"method": "early_exit", "num_draft_layers": 4},
        "early_exit_probabilistic": {"method": "early_exit", "num_draft_layers": 2,
                                     "draft_sample_method": "probabilistic"},
    }[name] | {"num_speculative_tokens": K}


def engine(target_dir, spec=None, max_num_seqs=8, dtype="float32"):
    return LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=max_num_seqs, speculative_config=spec)


def follow_schedule(llm: LLM) -> list[tuple[int, int, int]]:
    """Replace the engine's adaptive planning by DRAFT_SCHEDULE (per request, by its step count)
    and record (request_id, num_drafts, num_accepted) for every request of every step."""
    spec = llm.spec
    steps_taken: dict[int, int] = {}
    events: list[tuple[int, int, int]] = []

    def plan(batch):
        for r in batch:
            room = min(K, MAX_MODEL_LEN - r.num_tokens - 1,
                       r.params.max_tokens - r.num_output_tokens - 1)
            step = steps_taken.get(r.request_id, 0)
            steps_taken[r.request_id] = step + 1
            r.max_num_draft_tokens = max(0, min(room, DRAFT_SCHEDULE[step % len(DRAFT_SCHEDULE)]))

    propose, step = spec.proposer.propose, spec.step
    proposed = {}

    def recording_propose(requests):
        proposal = propose(requests)
        proposed["num_drafts"] = proposal.num_draft_tokens_cpu.copy()
        return proposal

    def recording_step(batch, sampling):
        outputs = step(batch, sampling)
        for r, n, out in zip(batch, proposed["num_drafts"], outputs):
            events.append((r.request_id, int(n), len(out) - 1))
        return outputs

    spec._plan = plan
    spec.proposer.propose = recording_propose
    spec.step = recording_step
    return events


PROMPTS_RNG = np.random.default_rng(0)
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive: n-gram finds drafts
PROMPTS = [PROMPT] + [PROMPTS_RNG.integers(3, VOCAB, size=n).tolist() for n in (2, 9, 40, 17, 50)]


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [o.token_ids for o in engine(target_dir).generate(PROMPTS, params)]


@pytest.mark.parametrize("name", ["ngram", "draft_model_greedy", "draft_model_probabilistic",
                                  "hybrid_draft_model", "early_exit_1", "early_exit_all"])
def test_greedy_speculative_equals_plain(name, target_dir, draft_dir, hybrid_draft_dir,
                                         plain_greedy):
    llm = engine(target_dir, spec_config(name, draft_dir, hybrid_draft_dir), max_num_seqs=3)
    events = follow_schedule(llm)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_greedy
    # The run held every kind of step the rollback must get right.
    all_accepted = [(rid, n) for rid, n, a in events if n > 0 and a == n]
    some_rejected = [(rid, n) for rid, n, a in events if n > 0 and a < n]
    assert all_accepted
    if name == "early_exit_all":  # the target's own greedy continuation: never rejected
        assert not some_rejected
    else:
        assert some_rejected
    last: dict[int, tuple[int, int]] = {}
    zero_after_accepted = 0
    for rid, n, a in events:
        if n == 0 and rid in last and last[rid][1] > 0:
            zero_after_accepted += 1
        last[rid] = (n, a)
    assert zero_after_accepted > 0


@pytest.mark.parametrize("name", ["ngram", "early_exit_1"])
def test_greedy_speculative_equals_plain_in_bfloat16(name, target_dir, draft_dir):
    """docs/design.md §12: in every dtype (the states stay float32; the bfloat16 projections are
    computed row by row alike in a decode and in a verify step)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = engine(target_dir, dtype="bfloat16").generate(PROMPTS, params)
    llm = engine(target_dir, spec_config(name, draft_dir), max_num_seqs=3, dtype="bfloat16")
    events = follow_schedule(llm)
    spec = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert any(n > 0 and a > 0 for _, n, a in events)


def _token_counts(llm, num_requests, seed_base, num_tokens):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed_base + i,
                             max_tokens=num_tokens, ignore_eos=True)
              for i in range(num_requests)]
    tokens = np.array([o.token_ids for o in llm.generate([PROMPT] * num_requests, params)])
    return np.stack([np.bincount(tokens[:, j], minlength=VOCAB) for j in range(num_tokens)])


NUM_REQUESTS = 3000
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def plain_counts(target_dir):
    return _token_counts(engine(target_dir, max_num_seqs=512), NUM_REQUESTS, 0, NUM_TOKENS)


@pytest.mark.parametrize("name", ["early_exit_probabilistic", "draft_model_probabilistic"])
def test_sampled_speculative_matches_plain_distribution(name, target_dir, draft_dir,
                                                        plain_counts):
    llm = engine(target_dir, spec_config(name, draft_dir), max_num_seqs=512)
    events = follow_schedule(llm)
    counts = _token_counts(llm, NUM_REQUESTS, 10_000_000, NUM_TOKENS)
    assert sum(a for _, _, a in events) > NUM_REQUESTS // 2  # drafts were really accepted
    for position in range(NUM_TOKENS):
        p = _two_sample_p(plain_counts[position], counts[position])
        assert p >= P_VALUE_THRESHOLD, f"{name}: token {position} p-value {p:.3g}"


def test_distribution_check_catches_a_cache_without_per_position_states(
        target_dir, draft_dir, plain_counts, monkeypatch):
    """Negative control: a state cache that keeps one state per slot (the state after the last
    token fed, as a model without speculative support would) continues from the wrong state
    after a rejection; the same check must fail."""
    from verispec.models import mamba2

    ends: dict[int, int] = {}
    update, write_conv = mamba2.ssm_state_update, mamba2.MambaLayerState.write_conv

    def last_only_update(ring, slots, starts, counts, *operands):
        ends.update(zip(slots.tolist(), (starts + counts).tolist()))
        before = ring.clone()
        y = update(ring, slots, starts, counts, *operands)
        last = (slots, (starts + counts) % ring.shape[1])
        final = ring[last]
        ring.copy_(before)
        ring[last] = final
        return y

    def last_only_conv(self, slots, lengths, values):
        keep = np.array([ends.get(s, n) == n for s, n in zip(slots.tolist(), lengths.tolist())])
        write_conv(self, slots[keep], lengths[keep], values[torch.from_numpy(keep)])

    monkeypatch.setattr(mamba2, "ssm_state_update", last_only_update)
    monkeypatch.setattr(mamba2.MambaLayerState, "write_conv", last_only_conv)
    llm = engine(target_dir, spec_config("early_exit_probabilistic", draft_dir),
                 max_num_seqs=512)
    follow_schedule(llm)
    counts = _token_counts(llm, NUM_REQUESTS, 10_000_000, NUM_TOKENS)
    p_values = [_two_sample_p(plain_counts[j], counts[j]) for j in range(NUM_TOKENS)]
    assert min(p_values) < P_VALUE_THRESHOLD


@pytest.mark.parametrize("name", [None, "ngram", "early_exit_1"])
def test_continuous_batching_never_mixes_slot_states(name, target_dir, draft_dir):
    """Ten requests through 3 slots (each joins when another leaves) give exactly the tokens
    each gives alone in a fresh engine: no state crosses slots, none is left behind in a slot."""
    spec = None if name is None else spec_config(name, draft_dir)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, size=int(n)).tolist()
               for n in (3, 45, 8, 36, 2, 20, 60, 5, 12, 40)]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, seed=100 + i,
                             max_tokens=int(m), ignore_eos=True)
              for i, m in enumerate(rng.integers(3, 25, size=len(prompts)))]
    batched = engine(target_dir, spec, max_num_seqs=3).generate(prompts, params)
    alone = engine(target_dir, spec, max_num_seqs=1)
    for prompt, p, out in zip(prompts, params, batched):
        assert alone.generate(prompt, p)[0].token_ids == out.token_ids
        assert len(out.token_ids) == p.max_tokens


def test_synthetic_mean_acceptance_length(target_dir):
    spec = {"method": "early_exit", "num_draft_layers": 1, "num_speculative_tokens": 4,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    llm = LLM(target_dir, dtype="float32", max_model_len=256, max_num_seqs=16,
              speculative_config=spec)
    params = [SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True, seed=i)
              for i in range(16)]
    llm.generate([PROMPT] * 16, params)
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_drafts"] >= 600
    assert metrics["mean_acceptance_length"] == pytest.approx(2.5, abs=0.1)


@pytest.mark.parametrize("mode", ["runner", "model"])
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_early_exit_rollback_matches_fresh_proposer(tmp_path, mode, method):
    """Early exit on a hybrid target over simulated steps with random draft and accept counts
    (zero, some, all accepted; a slot freed and reused): drafting in the target's own rows (its
    partial forward advances the first N layers' states, rolled back with the length) or in an own
    N-layer cache, the drafts equal a fresh proposer's on the same committed context."""
    from tests.proposers import test_draft_model as draft_tests
    from verispec.config import SpeculativeConfig
    from verispec.models import load_model
    from verispec.proposers import ProposerContext, build_proposer
    from verispec.runtime.model_runner import ModelRunner

    k = 3
    target = load_model(save_hybrid(tmp_path, vocab_size=draft_tests.VOCAB, seed=2))

    def early_exit(target_model):
        config = SpeculativeConfig(method="early_exit", num_speculative_tokens=k,
                                   num_draft_layers=2, draft_sample_method=method)
        return build_proposer(config, ProposerContext(
            max_num_seqs=4, max_model_len=draft_tests.MAX_MODEL_LEN,
            vocab_size=draft_tests.VOCAB, target_model=target_model))

    runner = ModelRunner(target.model, 4, draft_tests.MAX_MODEL_LEN, max_step_tokens=k + 1)
    proposer = early_exit(runner if mode == "runner" else target.model)
    assert proposer.shares_target_cache == (mode == "runner")
    draft_tests.check_rollback_over_steps(proposer, early_exit(target.model), k, seed=4,
                                          target_runner=runner if mode == "runner" else None)
