"""Structured output stays exact under speculation (docs/design.md §15).

Strategy: as tests/sample/test_options_exactness.py, with a grammar as the option. A vocabulary
of 29 tokens (0 = EOS, 1..26 = the letters a..z, 27 = "ab", 28 = "yz", so that one string has
several tokenisations) and a branching regex whose mask changes with the position and the
prefix (``[a-f]{1,3}(x|yz)e*``: letters, then a choice, then a tail, EOS only once it can end).
Each case runs many independently seeded copies of one request through the real draft sampler
(or greedy drafts under the one-hot rule), the real options processing (the matcher advanced
along d_1..d_i on the host, the masks applied on the device) and the real ``rejection_sample``.
Output column i given the accepted drafts before it must follow the one-token-at-a-time
distribution: the target row masked by a fresh matcher that consumed output + prefix. Every
(column, prefix) group with enough samples gets a chi-square test (p >= 1e-6); a token outside
the grammar must never appear. The draft rows push tokens the grammar refuses at some positions
(z, x too early, EOS), so drafts leave the grammar and are rejected. Greedy targets must emit the
masked argmax.

Grammar-aware drafting ("guided"): the draft logits of position i are masked by the matcher
walked along d_1..d_i (``ops.options.apply_token_bitmask``, as ``proposers.grammar_walk`` does)
before the real draft sampler draws d_{i+1}, and the rejection sampler gets that masked q. Every
draft is then inside the grammar and the same chi-square tests must pass; a greedy target with
guided greedy drafts emits the masked argmax, and the walk of ``GrammarMatcher`` gives the masks
``masks`` gives for the same drafts.
"""

from __future__ import annotations

from collections import defaultdict

import llguidance
import numpy as np
import pytest
import torch

from tests.sample.stats import (
    P_VALUE_THRESHOLD,
    chi_square_p_value,
    record,
    reference_probs,
)
from verispec import ops
from verispec.engine.request import Request
from verispec.ops.backend import get_backend, load_backend
from verispec.ops.options import apply_token_bitmask
from verispec.proposers.grammar_walk import GrammarWalks
from verispec.sample import grammar as grammar_module
from verispec.sample.grammar import begin_drafts, extend_drafts, fill_chain_masks
from verispec.sample.grammar_compiler import GrammarCompiler
from verispec.sample.options import RequestOptions, SamplingOptions
from verispec.sampling_params import SamplingParams, StructuredOutputsParams

V = 29
K = 3
EOS = 0
TOKENS = [b"</s>"] + [bytes([96 + i]) for i in range(1, 27)] + [b"ab", b"yz"]
PROMPT = [1, 2, 3]
OUTPUT = [1]  # "a"
REGEX = "[a-f]{1,3}(x|yz)e*"
NUM_REQUESTS = 30_000
CHUNK = 10_000
MIN_GROUP = 100
FAVOURED = (EOS, 2, 24, 25, 26, 27, 28, 5)  # EOS, b, x, y, z, "ab", "yz", e
GREEDY_DRAFTS = {"valid": [27, 24, 5],  # "ab", "x", "e": all inside the grammar
                 "invalid": [2, 26, 5]}  # "b", then "z": outside, rejected at row 1


class TinyTokenizer:
    """llguidance's view of the 29 tokens (longest match first)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = TOKENS
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for n in (2, 1):
                piece = bytes(text[i:i + n])
                if piece in TOKENS[1:]:
                    ids.append(TOKENS.index(piece))
                    i += n
                    break
            else:
                raise ValueError(text)
        return ids


def compiler(threads: int = 1) -> GrammarCompiler:
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TinyTokenizer()))
    return GrammarCompiler(ll, V, threads)


COMPILER = compiler()
THREADED = compiler(threads=3)  # masks on 3 threads, each grammar compiled in 3 lanes


def make_request(temperature: float, grammars: GrammarCompiler | None = None) -> Request:
    params = SamplingParams(max_tokens=40, temperature=temperature,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    r = Request(0, None, PROMPT, params, seed=0, max_model_len=100)
    for t in OUTPUT:
        r.append(t)
    r.slot = 0
    r.options = RequestOptions.build(params, V, [EOS], None, lambda: grammars or COMPILER)
    return r


def allowed(tokens: list[int]) -> np.ndarray:
    """[V] bool: the tokens a fresh matcher allows after ``tokens`` (the reference)."""
    matcher = llguidance.LLMatcher(COMPILER.ll_tokenizer,
                                   llguidance.grammar_from("regex", REGEX), log_level=0)
    assert matcher.consume_tokens(tokens), tokens
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return np.array([(mask[v >> 5] >> (v & 31)) & 1 for v in range(V)], dtype=bool)


def target_and_draft_logits(drafts: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    target = rng.normal(size=(K + 1, V)) * 1.5
    target[:, list(FAVOURED)] += 1.5
    draft = target[:K] + rng.normal(size=(K, V)) * 0.8
    if drafts in ("sampled", "guided"):
        draft[:, list(FAVOURED)] += 1.0
    else:
        draft[np.arange(K), GREEDY_DRAFTS[drafts]] += 20.0
        target[np.arange(K), GREEDY_DRAFTS[drafts]] += 3.0
    return target, draft


def run(drafts: str, num_requests: int, temperature: float = 1.0,
        backend: str | None = None, device: torch.device | str = "cpu") -> np.ndarray:
    """[num_requests, K + 1] output tokens (-1 padded), sampled on ``device`` with ``backend``
    (default: the device's)."""
    device = torch.device(device)
    request = make_request(temperature)
    target, draft = (torch.tensor(x, dtype=torch.float32, device=device)
                     for x in target_and_draft_logits(drafts))
    options = SamplingOptions(1, V, device)
    rejection_sample = (get_backend(device) if backend is None
                        else load_backend(backend)).rejection_sample
    outputs = []
    for start in range(0, num_requests, CHUNK):
        batch = min(CHUNK, num_requests - start)
        seeds = torch.arange(start, start + batch, dtype=torch.int64, device=device) * 7919 + 3
        positions = torch.full((batch,), len(PROMPT) + len(OUTPUT), dtype=torch.int64,
                               device=device)
        if drafts == "sampled":
            draft_ids, q = ops.sample_draft(
                draft.repeat(batch, 1), torch.full((batch * K,), max(temperature, 1e-3),
                                                   device=device),
                seeds.repeat_interleave(K),
                (positions[:, None] + torch.arange(K, device=device)).reshape(-1))
        elif drafts == "guided":
            draft_ids, q = guided_drafts(request, draft, batch, temperature, seeds, positions)
        else:
            draft_ids, q = draft.argmax(-1).repeat(batch), None
        # the same request in every row (one slot): its rows after the grammar's masks depend
        # on its drafts alone, so each distinct draft sequence is processed once and its rows
        # repeated (the same numbers as processing every copy)
        distinct, inverse = np.unique(draft_ids.reshape(batch, K).cpu().numpy(), axis=0,
                                      return_inverse=True)
        logits = options.process(target.repeat(len(distinct), 1), [request] * len(distinct),
                                 np.full(len(distinct), K),
                                 torch.from_numpy(distinct).view(-1).to(device))
        logits = logits.view(len(distinct), K + 1, V)[
            torch.from_numpy(inverse.reshape(-1)).to(device)]
        logits = logits.view(-1, V)
        outputs.append(rejection_sample(
            logits, draft_ids, torch.arange(batch + 1, dtype=torch.int32, device=device) * K, q,
            torch.full((batch,), temperature, device=device), None, None, None, seeds,
            positions, K).cpu().numpy())
    return np.concatenate(outputs)


def guided_drafts(request, draft: torch.Tensor, batch: int, temperature: float,
                  seeds: torch.Tensor, positions: torch.Tensor):
    """[batch * K] drafts and [batch * K, V] q drawn by the real draft sampler from the draft
    rows masked, per request, by the matcher walked along its drafts so far (one walk per
    distinct prefix: the masks depend on the drafts only through it)."""
    grammar = request.options.grammar
    grammar.sync(request.output_token_ids)
    device = draft.device
    ids = torch.zeros(batch, K, dtype=torch.int64, device=device)
    q = torch.zeros(batch, K, V, device=device)
    for i in range(K):
        prefixes = [tuple(row) for row in ids[:, :i].tolist()]
        masks = {p: grammar.masks(list(p))[i] for p in set(prefixes)}
        logits = draft[i].repeat(batch, 1)
        apply_token_bitmask(logits, torch.arange(batch, device=device),
                            torch.from_numpy(np.stack([masks[p] for p in prefixes])).to(device))
        ids[:, i], q[:, i] = ops.sample_draft(
            logits, torch.full((batch,), temperature, device=device), seeds, positions + i)
    return ids.reshape(-1), None if temperature == 0 else q.reshape(batch * K, V)


def reference(drafts: str, column: int, prefix: tuple[int, ...]) -> np.ndarray:
    target, _ = target_and_draft_logits(drafts)
    z = np.where(allowed(OUTPUT + list(prefix)), target[column], -np.inf)
    return reference_probs(z)


@pytest.mark.parametrize("drafts", ["sampled", "guided", "valid", "invalid"])
def test_each_position_follows_one_token_at_a_time(drafts, device):
    out = run(drafts, NUM_REQUESTS, device=device)
    groups = defaultdict(list)
    for column in range(K + 1):
        for row in out[out[:, column] >= 0, : column + 1]:
            groups[(column, tuple(row[:column].tolist()))].append(row[column])
    results = {}
    for (column, prefix), tokens in groups.items():
        counts = np.bincount(tokens, minlength=V)
        probs = reference(drafts, column, prefix)
        assert not counts[probs == 0].any(), (column, prefix, np.flatnonzero(counts * (
            probs == 0)))
        if len(tokens) >= MIN_GROUP:
            results[(column, prefix)] = (len(tokens), chi_square_p_value(counts, probs))
    # drafts are accepted (the test reaches past the first position) unless they leave it
    assert any(column >= (1 if drafts == "invalid" else 2) for column, _ in results)
    if drafts == "invalid":  # "z" after "b" is outside: never accepted
        assert not (out[:, 2] >= 0).any()
    if drafts == "guided":  # every draft inside the grammar: more of them accepted
        assert (out >= 0).sum() > (run("sampled", NUM_REQUESTS // 3, device=device) >= 0).sum() * 3
    record(f"grammar_{drafts}", NUM_REQUESTS, [p for _, p in results.values()])
    for (column, prefix), (n, p) in results.items():
        assert p >= P_VALUE_THRESHOLD, f"{drafts}: position {column} after {prefix} ({n}): {p}"


def test_greedy_target_emits_the_masked_argmax(device):
    for drafts in ("sampled", "guided", "valid", "invalid"):
        out = run(drafts, 300, temperature=0.0, device=device)
        argmax = {}  # of the masked row after each prefix, computed once
        for column in range(K + 1):
            for row in out[out[:, column] >= 0]:
                prefix = tuple(row[:column].tolist())
                if prefix not in argmax:
                    argmax[prefix] = int(np.argmax(reference(drafts, column, prefix)))
                assert row[column] == argmax[prefix], (drafts, column)


def test_matcher_follows_the_committed_tokens_only():
    """Masks for drafts leave the matcher where the committed output put it."""
    request = make_request(1.0)
    grammar = request.options.grammar
    grammar.sync(request.output_token_ids)
    before = grammar.masks([]).copy()
    grammar.masks([27, 24, 5])  # consumed, then rolled back
    grammar.masks([2, 26, 5])  # "z" refused: consumed up to "b" only
    assert np.array_equal(grammar.masks([]), before)
    request.append(27)
    grammar.sync(request.output_token_ids)
    bits = grammar.masks([])[0]
    assert [v for v in range(V) if (bits[v >> 5] >> (v & 31)) & 1] == np.flatnonzero(
        allowed([1, 27])).tolist()


def test_a_grammar_is_compiled_once_and_its_matchers_are_independent(monkeypatch):
    """Requests with one grammar get copies of one compiled matcher: each follows its own
    output; the compiler keeps the last ``CACHED_GRAMMARS`` grammars."""
    compiler_ = compiler()
    compiled = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **k: compiled.append(a) or real(
        *a, **k))
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", real.validate_grammar,
                        raising=False)
    params = StructuredOutputsParams(regex=REGEX)
    a, b = compiler_.matcher(params), compiler_.matcher(params)
    assert len(compiled) == 1 and a.matcher is not b.matcher
    a.sync(np.array([1, 27]))  # "a", "ab"
    b.sync(np.array([1]))
    for g, output in ((a, [1, 27]), (b, [1])):
        bits = g.masks([])[0]
        assert [v for v in range(V) if (bits[v >> 5] >> (v & 31)) & 1] == np.flatnonzero(
            allowed(output)).tolist()
    monkeypatch.setattr(GrammarCompiler, "CACHED_GRAMMARS", 2)
    compiled.clear()  # (``allowed`` compiles its own)
    for regex in ("a+", "b+", "c+"):
        compiler_.matcher(StructuredOutputsParams(regex=regex))
    assert len(compiler_._compiled) == 2 and len(compiled) == 3
    compiler_.matcher(params)  # dropped: compiled again
    assert len(compiled) == 4


def test_lanes_are_compiled_for_matchers_alive_at_once():
    """With mask threads a grammar gets another compilation (lane) only while every lane has a
    live matcher: requests one at a time keep one lane; four alive at once on three threads
    fill three, and a new matcher takes the lane a dropped one left."""
    grammars = compiler(threads=3)
    for _ in range(4):  # one at a time
        assert make_request(1.0, grammars).options.grammar.lane == 0
    ((lanes, live),) = grammars._compiled.values()
    assert len(lanes) == 1 and live == [0]
    alive = [make_request(1.0, grammars).options.grammar for _ in range(4)]
    assert [g.lane for g in alive] == [0, 1, 2, 0] and live == [2, 1, 1]
    del alive[1]
    assert make_request(1.0, grammars).options.grammar.lane == 1 and len(lanes) == 3


def test_a_walk_ended_before_its_last_draft_leaves_the_verify_step_one_row(monkeypatch):
    """A proposer ends a walk without reading its last draft (``GrammarWalks.advance`` with
    ``last``): the verify step's masks are those of a fresh matcher, and only the bonus row is
    computed there (none where an earlier draft left the grammar)."""
    computed = []
    real = grammar_module.compute_masks
    monkeypatch.setattr(grammar_module, "compute_masks",
                        lambda gs: computed.append(len(gs)) or real(gs))
    chains = [[27, 24, 5], [2, 26, 5], [2, 3], [5], [99, 2], [24, 24, 5]]
    grammars = [make_request(1.0).options.grammar for _ in chains]
    for g in grammars:
        g.sync(np.array(OUTPUT))
    walks = GrammarWalks(grammars)
    rows = np.arange(len(chains))
    for i in range(max(map(len, chains))):
        here = rows[[i < len(chains[a]) for a in rows]]
        last = np.array([i + 1 == len(chains[a]) for a in here])
        walks.advance(None if last.all() else [chains[a][i] for a in here], here, last)
    assert not walks and walks.masks == {}
    computed.clear()
    fill_chain_masks(grammars, chains)
    inside = sum(g.num_valid(d) == len(d) for g, d in zip(grammars, chains))
    assert inside == 3 and sum(computed) == inside  # one row each, for chains inside it
    for g, drafts in zip(grammars, chains):
        fresh = make_request(1.0).options.grammar
        fresh.sync(np.array(OUTPUT))
        assert np.array_equal(g.masks(drafts), fresh.masks(drafts)), drafts
        assert np.array_equal(g.masks([]), fresh.masks([]))  # rolled back


def test_greedy_walks_draft_the_masked_argmax():
    """``GrammarWalks(greedy=True).argmax`` (a mask only where the grammar refuses the unmasked
    argmax) drafts what the argmax of the masked logits drafts, ties included, along walks
    that stay in the grammar and walks that leave it."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        walks = {}
        for greedy in (False, True):
            grammars = [make_request(1.0).options.grammar for _ in range(6)]
            for g in grammars:
                g.sync(np.array(OUTPUT))
            walks[greedy] = GrammarWalks(grammars, greedy=greedy)
        rows, chains = np.arange(6), [[] for _ in range(6)]
        for i in range(3):
            logits = torch.from_numpy(rng.integers(0, 4, (6, V)).astype(np.float32))  # ties
            if trial % 2:
                logits[:, FAVOURED[:3]] += 10.0  # EOS, b, x: refused at some positions
            eager = torch.argmax(walks[False].apply(logits, rows), dim=-1)
            lazy, host = walks[True].argmax(logits, rows, lambda x: torch.argmax(x, dim=-1))
            assert torch.equal(eager, lazy) and host == lazy.tolist(), (trial, i)
            last = np.full(6, i == 2)
            for w in walks.values():
                w.advance(eager.tolist(), rows, last)
            for chain, token in zip(chains, host):
                chain.append(token)
        assert not walks[False] and not walks[True]
        # the verify step's rows: the greedy walk's few masks and the rest computed there
        fill_chain_masks(walks[True].grammars, chains)
        for g, drafts in zip(walks[True].grammars, chains):
            fresh = make_request(1.0).options.grammar
            fresh.sync(np.array(OUTPUT))
            assert np.array_equal(g.masks(drafts), fresh.masks(drafts)), (trial, drafts)
            assert np.array_equal(g.masks([]), fresh.masks([]))  # rolled back


def test_a_chain_past_the_grammar_s_end_leaves_the_matcher_intact():
    """A grammar complete after d_2 ("ab"): the matcher stops there and consumes nothing more
    (an end token on a stopped matcher would put it in error, beyond any rollback); the rows
    after repeat its last, and the matcher stays at the committed output."""
    compiler_ = compiler()
    for chain in ([1, 2, EOS, EOS], [27, EOS, EOS], [1, 2, 3]):
        g = compiler_.matcher(StructuredOutputsParams(regex="ab"))
        before = g.masks([]).copy()
        rows = g.masks(chain)
        g._memo.clear()
        assert np.array_equal(g.masks([]), before)  # rolled back, not in error
        assert not g.matcher.is_error()
        stop = 2 if chain[0] == 1 else 1  # the row after "ab"
        assert (rows[stop + 1:] == rows[stop]).all()
        g.sync(np.array(chain[:stop] + [EOS]))  # committed: "ab" then the end
        assert not g.matcher.is_error()


def test_the_drafting_walk_gives_the_verify_masks():
    """begin_draft / extend_draft give the masks ``masks`` gives for the same drafts (inside the
    grammar and leaving it), keep them for the verify step and roll the matcher back."""
    for drafts in ([27, 24, 5], [2, 26, 5], [2, 3], []):
        request = make_request(1.0)
        grammar = request.options.grammar
        grammar.sync(request.output_token_ids)
        walked = [grammar.begin_draft()] + [grammar.extend_draft(t) for t in drafts]
        grammar.end_draft()
        fresh = make_request(1.0).options.grammar
        fresh.sync(request.output_token_ids)
        want = fresh.masks(drafts)
        assert np.array_equal(np.stack(walked), want), drafts
        assert grammar.masks(drafts) is grammar._memo[tuple(drafts)]
        assert np.array_equal(grammar.masks([]), fresh.masks([]))  # rolled back
        assert grammar.num_valid(drafts) == {(27, 24, 5): 3, (2, 26, 5): 1}.get(
            tuple(drafts), len(drafts))


def test_triton_backend_gives_the_same_tokens(device):
    """The Triton backend (its interpreter on the CPU) emits the torch backend's tokens on the
    same device."""
    for drafts in ("sampled", "guided", "invalid"):
        assert np.array_equal(run(drafts, 32, backend="triton", device=device),
                              run(drafts, 32, backend="torch", device=device))


@pytest.mark.parametrize("threads", [1, 3])
def test_batched_masks_equal_one_matcher_at_a_time(threads):
    """The masks computed for many requests at once (``fill_chain_masks`` depth by depth,
    ``begin_drafts`` / ``extend_drafts``) are each matcher's own: the verify rows of several
    chains (drafts inside the grammar, leaving it, empty, out of the vocabulary) and the
    drafting walks; on one thread, and on three (the requests spread over three compilations
    of the grammar) against one matcher at a time on one."""
    grammars = THREADED if threads > 1 else COMPILER
    chains = [[27, 24, 5], [2, 26, 5], [2, 3], [], [3, 4, 5, 24], [99, 2]]
    batched = [make_request(1.0, grammars).options.grammar for _ in chains]
    assert {g.lane for g in batched} == set(range(threads))
    for g in batched:
        g.sync(np.array(OUTPUT))
    fill_chain_masks(batched, chains)
    for g, drafts in zip(batched, chains):
        fresh = make_request(1.0).options.grammar
        fresh.sync(np.array(OUTPUT))
        assert np.array_equal(g.masks(drafts), fresh.masks(drafts)), drafts
        assert np.array_equal(g.masks([]), fresh.masks([]))  # rolled back
    # one matcher listed several times (a chain repeated): each distinct chain filled once
    shared = make_request(1.0, grammars).options.grammar
    shared.sync(np.array(OUTPUT))
    listed = [chains[0], chains[1], chains[0], chains[4], chains[1]]
    fill_chain_masks([shared] * len(listed), listed)
    assert sorted(shared._memo) == sorted({tuple(c) for c in listed})
    for drafts in listed:
        fresh = make_request(1.0).options.grammar
        fresh.sync(np.array(OUTPUT))
        assert np.array_equal(shared.masks(drafts), fresh.masks(drafts)), drafts
    walks = [make_request(1.0, grammars).options.grammar for _ in chains]
    for g in walks:
        g.sync(np.array(OUTPUT))
    steps = [begin_drafts(walks)]
    for i in range(4):
        steps.append(extend_drafts(walks, [c[i] if i < len(c) else 2 for c in chains]))
    for j, g in enumerate(walks):
        g.end_draft()
        drafts = (chains[j] + [2] * 4)[:4]
        fresh = make_request(1.0).options.grammar
        fresh.sync(np.array(OUTPUT))
        assert np.array_equal(np.stack([s[j] for s in steps]), fresh.masks(drafts)), drafts


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mapped", [False, True])
def test_token_bitmask_masks_exactly_the_refused_tokens(mapped, backend, device):
    """``apply_token_bitmask`` against a bit-by-bit reference: rows out of order, a vocabulary
    that is not a multiple of 32 (nor of the Triton twin's block: 1100 columns), an EAGLE-3
    column map onto target ids, and rows and masks as strided columns of one upload (the
    drafting walks'); the torch twin and the Triton one (in the interpreter on the CPU)."""
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 1100, torch.tensor([4, 0, 2])
    words = (vocab + 31) // 32
    wide = torch.randint(-2**31, 2**31 - 1, (3, words + 1), dtype=torch.int32, generator=gen)
    wide[:, -1] = rows  # the rows in a last column, as the drafting walks upload them
    bitmask = wide[:, :words]  # strided rows
    token_ids = torch.randperm(vocab, generator=gen)[:1050] if mapped else None
    logits = torch.randn(6, 1050 if mapped else vocab, generator=gen)
    want = logits.clone()
    for g, row in enumerate(rows.tolist()):
        for col in range(want.shape[1]):
            t = int(token_ids[col]) if mapped else col
            if not (int(bitmask[g, t // 32]) >> (t % 32)) & 1:
                want[row, col] = float("-inf")
    got = logits.to(device)
    packed = wide.to(device)
    load_backend(backend).apply_token_bitmask(
        got, packed[:, -1], packed[:, :words],
        None if token_ids is None else token_ids.to(device))
    assert torch.equal(got.cpu(), want)
