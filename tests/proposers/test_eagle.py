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

Under a grammar (docs/design.md §15): the 29-token vocabulary and branching regex of
tests/sample/test_grammar_exactness.py, a target over it and an EAGLE-3 head whose draft
vocabulary leaves some of the grammar's tokens out. Many requests, each with its own matcher,
draft through the real proposer (head logits masked by the matcher walked along the drafts,
then the real draft sampler) and are verified by the real options processing and rejection
sampler; every draft must be inside the grammar, q zero outside it, and each output position's
distribution, given the accepted drafts before it, must follow one-token-at-a-time sampling
from the masked target row (chi-square per group). The static-buffer (CUDA-graph) layout drafts
such a batch eagerly, as the eager layout does, and drafts nothing ahead for it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.proposers.test_draft_model import save_llama
from tests.proposers.test_eagle_loader import eagle_checkpoint, eagle_proposer, write_checkpoint
from tests.sample import test_grammar_exactness as grammar_case
from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from verispec import ops
from verispec.engine.llm import LLM
from verispec.models import load_model
from verispec.runtime.model_runner import ModelRunner
from verispec.sample.grammar import GrammarMatcher
from verispec.sample.options import SamplingOptions
from verispec.sampling_params import SamplingParams, StructuredOutputsParams

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
            # the eager flat layout runs the torch twins, whose matmul rows depend on how many
            # rows a forward holds, and the fresh proposer prefills each context at once: on an
            # AMD EPYC (AVX-512) one probability moved by 1.9e-5 (the tokens stay equal)
            tol = dict(atol=1e-4, rtol=1e-3) if layout == "flat" else dict(atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.draft_probs, want.draft_probs, **tol)
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


# ----------------------------------------------------------------- exactness under a grammar

GRAMMAR_REQUESTS = 20_000
GRAMMAR_TEMPERATURE = 0.8
# the head's draft vocabulary: all of grammar_case's tokens but g..l and "yz" (the grammar's
# choice (x|yz) is then drafted as x or y, z; its other letters are never drafted)
HEAD_TOKENS = [t for t in range(grammar_case.V) if not 7 <= t <= 12 and t != 28]


@pytest.fixture(scope="module")
def grammar_head(tmp_path_factory) -> tuple[str, str]:
    """(target directory, EAGLE-3 head directory) over grammar_case's 29 tokens."""
    target_dir = save_llama(tmp_path_factory.mktemp("grammar_target"), num_layers=6,
                            vocab_size=grammar_case.V)
    config, state = eagle_checkpoint("eagle3", load_model(target_dir).config, seed=2,
                                     draft_vocab_size=len(HEAD_TOKENS), scale=0.2)
    ids = torch.tensor(HEAD_TOKENS)
    state["d2t"] = ids - torch.arange(len(HEAD_TOKENS))
    state["t2d"] = torch.zeros(grammar_case.V, dtype=torch.bool)
    state["t2d"][ids] = True
    return target_dir, write_checkpoint(tmp_path_factory.mktemp("grammar_head"), config, state)


def _grammar_outputs(target_dir: str, head_dir: str) -> np.ndarray:
    """[GRAMMAR_REQUESTS, K + 1] output tokens (-1 padded) of one verify step per request:
    context grammar_case.PROMPT + OUTPUT, drafts from the head under each request's own
    matcher, the target's fixed rows (``target_and_draft_logits``) masked along the drafts."""
    V, temperature = grammar_case.V, GRAMMAR_TEMPERATURE
    prompt, output = grammar_case.PROMPT, grammar_case.OUTPUT
    runner = ModelRunner(load_model(target_dir).model, CHUNK, 8)
    proposer = eagle_proposer(head_dir, "eagle3", runner, K, "probabilistic", max_num_seqs=CHUNK)
    target_logits = torch.tensor(grammar_case.target_and_draft_logits("guided")[0],
                                 dtype=torch.float32)  # [K + 1, V]
    verify_request = grammar_case.make_request(temperature)  # its matcher: the verify masks
    options = SamplingOptions(1, V, torch.device("cpu"))
    # one compiled matcher, copied per request (compiling one takes milliseconds)
    compiled = grammar_case.COMPILER.matcher(StructuredOutputsParams(regex=grammar_case.REGEX))
    outputs, slots = [], list(range(CHUNK))
    for start in range(0, GRAMMAR_REQUESTS, CHUNK):
        requests = [Request(prompt + output, s, temperature=temperature, seed=start + s)
                    for s in slots]
        for r in requests:
            r.grammar = GrammarMatcher(compiled.matcher.deep_copy(), V)
            r.grammar.sync(np.array(output))
            proposer.free(r.slot)
            runner.kv_cache.free(r.slot)
        runner.forward(slots, [prompt] * CHUNK, logits="none")  # the prompt's hidden states
        proposer.on_commit(slots, [len(prompt) + len(output)] * CHUNK)
        proposal = proposer.propose(requests)
        draft_ids, q = proposal.draft_token_ids, proposal.draft_probs
        assert proposal.cu_num_draft_tokens[-1] == CHUNK * K
        drafts = draft_ids.view(CHUNK, K).numpy()
        for r, d in zip(requests[:200], drafts):  # inside the grammar, q zero outside it
            ends = np.flatnonzero(d == grammar_case.EOS)  # drafts after EOS are never verified
            n = int(ends[0]) + 1 if ends.size else K
            assert r.grammar.num_valid(d[:n].tolist()) == n, d
            for i in range(n):
                refused = ~grammar_case.allowed(output + d[:i].tolist())
                assert not q[r.slot * K + i, refused].any(), (d, i)
        logits = options.process(target_logits.repeat(CHUNK, 1), [verify_request] * CHUNK,
                                 np.full(CHUNK, K), draft_ids)
        seeds = torch.tensor([r.seed for r in requests])
        outputs.append(ops.rejection_sample(
            logits, draft_ids, proposal.cu_num_draft_tokens.to(torch.int32), q,
            torch.full((CHUNK,), temperature), None, None, None, seeds,
            torch.full((CHUNK,), len(prompt) + len(output), dtype=torch.int64), K).numpy())
    return np.concatenate(outputs)


def _grammar_requests(compiled, temperature: float = 0.8) -> list[Request]:
    """Two requests after grammar_case's prompt and output, each with its own matcher."""
    requests = [Request(grammar_case.PROMPT + grammar_case.OUTPUT, s, temperature=temperature,
                        seed=40 + s) for s in range(2)]
    for r in requests:
        r.grammar = GrammarMatcher(compiled.matcher.deep_copy(), grammar_case.V)
        r.grammar.sync(np.array(grammar_case.OUTPUT))
    return requests


def test_a_batch_with_a_grammar_drafts_eagerly(grammar_head):
    """The captured draft masks nothing: with a grammar the static-buffer (CUDA-graph) layout
    drafts eagerly, the drafts and q of the eager flat layout, all inside the grammar, and
    drafts nothing ahead; the same requests without their grammar replay the graph."""
    target_dir, head_dir = grammar_head
    target = load_model(target_dir)
    compiled = grammar_case.COMPILER.matcher(StructuredOutputsParams(regex=grammar_case.REGEX))
    proposals, replays = {}, []
    for layout in ("flat", "flat_graphs"):
        runner, proposer = _runner_and_proposer(target, head_dir, "eagle3", "probabilistic",
                                                layout)
        def counted(*args, replay=proposer._draft_replay, layout=layout):
            replays.append(layout)
            replay(*args)

        proposer._draft_replay = counted
        requests = _grammar_requests(compiled)
        slots = [r.slot for r in requests]
        runner.forward(slots, [grammar_case.PROMPT] * 2, logits="none")
        proposer.on_commit(slots, [len(r.token_ids) for r in requests])
        proposals[layout] = proposal = proposer.propose(requests)
        for r, d in zip(requests, _split(proposal)):
            assert r.grammar.num_valid(d) == K, d
        if layout == "flat_graphs":
            assert not replays
            runner.verify(slots, [r.token_ids[-1] for r in requests], proposal.draft_token_ids,
                          proposal.num_draft_tokens_cpu)
            out = torch.tensor([[d[0], -1, -1, -1] for d in _split(proposal)])
            assert not proposer.draft_ahead(requests, out)
            for r, d in zip(requests, _split(proposal)):
                r.token_ids.append(d[0])
                r.grammar = None
                runner.kv_cache.truncate(r.slot, len(r.token_ids) - 1)
            proposer.on_commit(slots, [len(r.token_ids) for r in requests])
            proposer.propose(requests)
            assert replays
    assert proposals["flat"].draft_token_ids.tolist() == \
        proposals["flat_graphs"].draft_token_ids.tolist()
    torch.testing.assert_close(proposals["flat"].draft_probs,
                               proposals["flat_graphs"].draft_probs)


def test_drafts_under_a_grammar_keep_each_position_exact(grammar_head):
    """Chi-square per (output position, accepted drafts before it) group against the target
    row masked by a fresh matcher after the output and that prefix, at the temperature; the
    output ends at EOS, so a prefix holding EOS is not a group."""
    out = _grammar_outputs(*grammar_head)
    target_logits = grammar_case.target_and_draft_logits("guided")[0]
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for row in out:
        for column in range(K + 1):
            if row[column] < 0 or grammar_case.EOS in row[:column]:
                break
            groups.setdefault((column, tuple(row[:column].tolist())), []).append(row[column])
    results = {}
    for (column, prefix), tokens in groups.items():
        counts = np.bincount(tokens, minlength=grammar_case.V)
        z = np.where(grammar_case.allowed(grammar_case.OUTPUT + list(prefix)),
                     target_logits[column], -np.inf)
        probs = reference_probs(z, GRAMMAR_TEMPERATURE)
        assert not counts[probs == 0].any(), (column, prefix)
        if len(tokens) >= grammar_case.MIN_GROUP:
            results[(column, prefix)] = (len(tokens), chi_square_p_value(counts, probs))
    assert any(column >= 2 for column, _ in results), sorted(results)  # drafts accepted
    record("eagle3 head under a grammar", GRAMMAR_REQUESTS, [p for _, p in results.values()])
    for (column, prefix), (n, p) in results.items():
        assert p >= P_VALUE_THRESHOLD, f"position {column} after {prefix} ({n}): {p}"


def test_commit_beyond_the_target_forward_names_the_slot_and_positions(head, target):
    """on_commit takes the hidden states of the committed pairs from the target's last forward:
    a commit past what that forward fed is one clear error naming the slot and positions."""
    method, head_dir = head
    runner, proposer = _runner_and_proposer(target, head_dir, method, "greedy", "flat")
    requests = [Request([3, 4, 5, 6], s) for s in range(2)]
    _prefill(runner, proposer, requests)  # pairs of positions 0 .. 3 known
    with pytest.raises(RuntimeError, match=r"lacks the hidden states of positions 4 \.\. 5 "
                                           r"of slot 1"):
        proposer.on_commit([0, 1], [len(requests[0].token_ids), len(requests[1].token_ids) + 2])
