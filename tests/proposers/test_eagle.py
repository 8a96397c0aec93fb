"""EAGLE proposers: cache and rollback, the engine end to end, and exactness through the head.

Strategy: a tiny random Llama target (float32) and random heads written as checkpoints
(``test_eagle_loader``). Rollback: many simulated steps with random n_r and accept counts
(zero, some, all; n_r = 0 steps too) through the real target runner's verify forwards; each
step's drafts and q must equal those of a fresh proposer given the same committed context in one
prefill, which proves the head's cache and the pending target hidden states are right, not just
counted. Engine: greedy speculation with a head emits exactly the plain greedy tokens. Exactness:
the chi-square suite with the drafts and q of the real head (reduced draft vocabulary, q scattered
onto the target vocabulary) and the real draft sampler, greedy and probabilistic, against the
processed target distribution; a wrong q must fail the same test.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.proposers.test_draft_model import save_llama
from tests.proposers.test_eagle_loader import eagle_checkpoint, eagle_proposer, write_checkpoint
from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from verispec import ops
from verispec.engine.llm import LLM
from verispec.models import load_model
from verispec.runtime.model_runner import ModelRunner
from verispec.sampling_params import SamplingParams

VOCAB = 64
K = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return save_llama(tmp_path_factory.mktemp("eagle_target"), num_layers=6)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


@pytest.fixture(scope="module", params=["eagle3", "eagle"])
def head(request, target, tmp_path_factory) -> tuple[str, str]:
    method = request.param
    config, state = eagle_checkpoint(method, target.config, seed=11,
                                     draft_vocab_size=40 if method == "eagle3" else None)
    return method, write_checkpoint(tmp_path_factory.mktemp(method), config, state)


class Request:
    def __init__(self, token_ids, slot, temperature=1.0, seed=0):
        self.token_ids, self.slot = list(token_ids), slot
        self.temperature, self.seed = temperature, seed
        self.max_num_draft_tokens = K


def _split(proposal) -> list[list[int]]:
    cu = proposal.cu_num_draft_tokens.tolist()
    ids = proposal.draft_token_ids.tolist()
    return [ids[cu[r]:cu[r + 1]] for r in range(len(cu) - 1)]


def _prefill(runner: ModelRunner, proposer, requests) -> None:
    """The engine's prefill: target forward over each prompt, commit one more token, roll the
    target cache back to all committed tokens but the last."""
    runner.forward([r.slot for r in requests], [r.token_ids for r in requests])
    for r in requests:
        r.token_ids.append((7 * r.slot + 3) % VOCAB)
        runner.kv_cache.truncate(r.slot, len(r.token_ids) - 1)
    proposer.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])


def _runner_and_proposer(target, head_dir: str, method: str, sample_method: str, layout: str):
    """A target runner and a head on it: ``padded`` (the CPU layout), ``flat`` (the GPU layout
    through the torch twins, every step eager) or ``flat_graphs`` (the GPU layout with the
    captured steps run on their static buffers, as a CUDA graph replays them)."""
    if layout == "padded":
        runner = ModelRunner(target.model, 3, 96)
    else:
        runner = ModelRunner(target.model, 3, 96, flat_layout=True, max_step_tokens=K + 1,
                             enforce_eager=layout == "flat")
    proposer = eagle_proposer(head_dir, method, runner, K, sample_method, max_num_seqs=3)
    runner.capture([1, K + 1])  # no-op without graphs
    proposer.capture()
    assert proposer.runner.flat == (layout != "padded")
    assert proposer.runner.graphs is None or proposer.runner.graphs.has("draft")
    return runner, proposer


@pytest.mark.parametrize("layout", ["padded", "flat", "flat_graphs"])
@pytest.mark.parametrize("sample_method", ["greedy", "probabilistic"])
def test_rollback_matches_fresh_proposer(head, target, sample_method, layout):
    """Against a fresh proposer of the same layout (with graphs, a fresh proposer's first draft
    catches the prompt up eagerly, then replays), and with graphs against the eager flat
    layout too: the static-buffer step drafts what the eager steps draft."""
    method, head_dir = head
    rng = random.Random(4)
    runner, proposer = _runner_and_proposer(target, head_dir, method, sample_method, layout)
    fresh_runner, fresh = _runner_and_proposer(
        target, head_dir, method, sample_method, "flat" if layout == "flat_graphs" else layout)
    assert (proposer.draft_probs_buffer is None) == (sample_method == "greedy")
    requests = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))], s,
                        temperature=[0.7, 1.0, 1.4][s], seed=100 + s) for s in range(3)]
    _prefill(runner, proposer, requests)
    seen, queued = set(), 0
    for step in range(24):
        for r in requests:
            r.max_num_draft_tokens = rng.randint(0, K)
        # the reference: a fresh proposer fed each committed context in one prefill
        for r in requests:
            fresh.free(r.slot)
            fresh_runner.kv_cache.free(r.slot)
        fresh_runner.forward([r.slot for r in requests], [r.token_ids for r in requests],
                             logits="none")
        fresh.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])
        want = fresh.propose(requests)
        got = proposer.propose(requests)
        assert got.cu_num_draft_tokens.tolist() == want.cu_num_draft_tokens.tolist()
        assert got.draft_token_ids.tolist() == want.draft_token_ids.tolist(), f"step {step}"
        if sample_method == "probabilistic":
            torch.testing.assert_close(got.draft_probs, want.draft_probs, atol=1e-5, rtol=1e-4)
        for r, n in zip(requests, got.num_draft_tokens_cpu):
            # cached (fed with target hidden states) + pending = the known pairs; a request
            # that drafted has fed them all, one with n_r = 0 catches up when it drafts
            cached = proposer.num_cached_tokens[r.slot]
            assert cached + proposer.num_pending[r.slot] == len(r.token_ids) - 1
            assert n == 0 or cached == len(r.token_ids) - 1
        # the verify forward, then a simulated verification: zero, all or some accepted
        drafts = _split(got)
        runner.verify([r.slot for r in requests], [r.token_ids[-1] for r in requests],
                      got.draft_token_ids, got.num_draft_tokens_cpu)
        outputs = []
        for d in drafts:
            accepted = rng.choice([0, len(d), rng.randint(0, len(d))])
            seen.add("none" if not d else "all" if accepted == len(d) else
                     "zero" if accepted == 0 else "some")
            outputs.append(d[:accepted] + [rng.randrange(VOCAB)])
        if layout == "flat_graphs":  # the engine queues the next draft before the commit
            out = torch.tensor([o + [-1] * (K + 1 - len(o)) for o in outputs])
            queued += proposer.draft_ahead(requests, out)
        for r, o in zip(requests, outputs):
            r.token_ids += o
            runner.kv_cache.truncate(r.slot, len(r.token_ids) - 1)
        proposer.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])
        if step == 12:  # a request finishes; a new one takes its slot
            proposer.free(1)
            runner.kv_cache.free(1)
            requests[1] = Request([5, 6, 7], 1, temperature=0.9, seed=7)
            _prefill(runner, proposer, [requests[1]])
    assert seen == {"none", "zero", "some", "all"}
    if layout == "flat_graphs":  # drafted ahead after every step verified through the graph
        assert 10 < queued < 24, queued


def test_draft_vocabulary_maps_onto_the_target(head, target):
    """Greedy drafts and every token with q > 0 lie in the head's map; q sums to 1."""
    method, head_dir = head
    runner = ModelRunner(target.model, 2, 64)
    proposer = eagle_proposer(head_dir, method, runner, K, "probabilistic", max_num_seqs=2)
    requests = [Request([1, 2, 3, 4], 0, temperature=1.0, seed=1),
                Request([9, 8], 1, temperature=0.0, seed=2)]
    _prefill(runner, proposer, requests)
    proposal = proposer.propose(requests)
    q = proposal.draft_probs
    assert q.dtype == torch.float32 and q.shape == (2 * K, VOCAB)
    torch.testing.assert_close(q.sum(-1), torch.ones(2 * K))
    if proposer.draft_to_target is not None:
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[proposer.draft_to_target] = False
        assert outside.sum() == VOCAB - 40 and (q[:, outside] == 0).all()
        assert all(int(t) in set(proposer.draft_to_target.tolist())
                   for t in proposal.draft_token_ids)


@pytest.mark.parametrize("sample_method", ["greedy", "probabilistic"])
def test_greedy_speculation_equals_plain_greedy(head, target_dir, sample_method):
    method, head_dir = head
    prompts = [[1, 5, 9, 13, 2, 40], [7, 7, 3], list(range(20, 31))]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(target_dir, dtype="float32", max_num_seqs=2).generate(prompts, params)
    llm = LLM(target_dir, dtype="float32", max_num_seqs=2, speculative_config={
        "method": method, "model": head_dir, "num_speculative_tokens": K,
        "draft_sample_method": sample_method})
    spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
    assert llm.spec.stats.num_drafts > 0


# ----------------------------------------------------------------------------- exactness

NUM_REQUESTS = 20_000
CHUNK = 10_000


def _emitted_counts(head_dir: str, target, sample_method: str, temperature: float,
                    target_logits: torch.Tensor, wrong_q: bool = False) -> np.ndarray:
    """[K + 1, V] counts of the tokens emitted at each output position over NUM_REQUESTS
    requests, drafted by the real head from one context with distinct seeds and verified
    against the fixed ``target_logits`` [K + 1, V]."""
    runner = ModelRunner(target.model, CHUNK, 8)
    proposer = eagle_proposer(head_dir, "eagle3", runner, K, sample_method, max_num_seqs=CHUNK)
    counts = np.zeros((K + 1, VOCAB), dtype=np.int64)
    for start in range(0, NUM_REQUESTS, CHUNK):
        requests = [Request([3, 17, 29], s, temperature=temperature, seed=start + s)
                    for s in range(CHUNK)]
        for r in requests:
            proposer.free(r.slot)
            runner.kv_cache.free(r.slot)
        _prefill(runner, proposer, requests)
        proposal = proposer.propose(requests)
        assert proposal.cu_num_draft_tokens[-1] == CHUNK * K
        q = proposal.draft_probs
        if wrong_q:  # the test of the test: q at another temperature than the drafts' own
            head_logits = torch.log(q.clamp_min(1e-30))
            q = torch.softmax(head_logits * 0.5, dim=-1)
        seeds = torch.tensor([r.seed for r in requests])
        out = ops.rejection_sample(
            target_logits.repeat(CHUNK, 1), proposal.draft_token_ids,
            proposal.cu_num_draft_tokens.to(torch.int32), q,
            torch.full((CHUNK,), temperature), None, None, None, seeds,
            torch.full((CHUNK,), 4, dtype=torch.int64), K).numpy()
        for col in range(K + 1):
            tokens = out[:, col]
            counts[col] += np.bincount(tokens[tokens >= 0], minlength=VOCAB)
    return counts


@pytest.fixture(scope="module")
def reduced_head(target, tmp_path_factory) -> str:
    """An EAGLE-3 head over 40 of the 64 tokens whose drafts often match the target logits of
    the exactness cases (so late positions are reached)."""
    config, state = eagle_checkpoint("eagle3", target.config, seed=21, draft_vocab_size=40,
                                     scale=0.15)
    return write_checkpoint(tmp_path_factory.mktemp("reduced"), config, state)


@pytest.fixture(scope="module")
def target_logits(reduced_head, target) -> torch.Tensor:
    """[K + 1, V] fixed target logits, raised at the head's greedy drafts of the context so
    that every output position is reached often (any fixed p is a valid test of exactness)."""
    runner = ModelRunner(target.model, 1, 8)
    proposer = eagle_proposer(reduced_head, "eagle3", runner, K, "greedy", max_num_seqs=1)
    request = Request([3, 17, 29], 0)
    _prefill(runner, proposer, [request])
    drafts = proposer.propose([request]).draft_token_ids
    logits = torch.randn(K + 1, VOCAB, generator=torch.Generator().manual_seed(5)) * 1.5
    logits[torch.arange(K), drafts] += 3.0
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("sample_method,temperature", [("probabilistic", 0.8),
                                                       ("greedy", 1.0)])
def test_emitted_tokens_follow_target_through_the_head(reduced_head, target, target_logits,
                                                       sample_method, temperature):
    counts = _emitted_counts(reduced_head, target, sample_method, temperature, target_logits)
    assert counts[0].sum() == NUM_REQUESTS and counts[K].sum() > 0
    values = [chi_square_p_value(counts[c], reference_probs(target_logits[c].numpy(),
                                                            temperature))
              for c in range(K + 1)]
    record(f"eagle3 head, {sample_method} drafts, T={temperature}", NUM_REQUESTS, values)
    assert min(values) >= P_VALUE_THRESHOLD, values


@pytest.mark.slow
def test_wrong_draft_probs_fail_the_test(reduced_head, target, target_logits):
    counts = _emitted_counts(reduced_head, target, "probabilistic", 1.0, target_logits,
                             wrong_q=True)
    values = [chi_square_p_value(counts[c], reference_probs(target_logits[c].numpy(), 1.0))
              for c in range(K + 1)]
    assert min(values) < P_VALUE_THRESHOLD, values


@pytest.mark.slow
def test_eagle3_on_the_quantised_bundled_model(tmp_path):
    """Regression: an EAGLE-3 head without an embedding of its own reads the target's, which
    the bundled GGUF keeps quantised (the head's lookup failed with a TypeError). Greedy
    speculation emits the plain greedy tokens."""
    plain = LLM(max_model_len=256)
    config, state = eagle_checkpoint("eagle3", plain.model_config, seed=1, draft_vocab_size=512)
    head = write_checkpoint(tmp_path, config, state)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = plain.generate(["Hello there"], params)[0].token_ids
    spec = LLM(max_model_len=256, speculative_config={"method": "eagle3", "model": head,
                                                      "num_speculative_tokens": 3})
    assert spec.generate(["Hello there"], params)[0].token_ids == expected
    assert spec.get_metrics()["spec_decoding"]["num_drafts"] > 0
