"""Draft-model proposer.

Strategy: tiny random Llama models written with transformers' ``save_pretrained`` and loaded by
our loader, float32. Drafts are checked against independent references computed token by token:
a plain ``ModelRunner`` greedy loop (and HF transformers' argmax) for greedy drafting, and
``softmax(logits / T)`` plus ``sample_draft`` at each draft's absolute position for probabilistic
drafting. The cache is checked over many simulated steps with random accept counts (zero, some,
all): its length must follow the committed-length rule, and the drafts of the next step must equal
those of a fresh proposer fed the same committed context, which proves the kept rows are right,
not just the counters. Also: one forward per draft position for a mixed batch (n_r = 0 included),
the float32 buffer is allocated once, and a vocabulary mismatch is a clear error.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import llguidance
import numpy as np
import pytest
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.models import load_model
from verispec.proposers import (
    DraftModelProposer,
    ProposalRequest,
    ProposerContext,
    build_proposer,
    get_proposer_cls,
)
from verispec.runtime.model_runner import ModelRunner
from verispec.sample.grammar_compiler import GrammarCompiler
from verispec.sampling_params import StructuredOutputsParams

VOCAB = 64
MAX_MODEL_LEN = 160


@dataclass
class Request:
    token_ids: list[int]
    max_num_draft_tokens: int
    slot: int = 0
    temperature: float = 0.0
    seed: int = 0


def save_llama(path, *, num_layers: int = 3, vocab_size: int = VOCAB, seed: int = 0,
               hidden_size: int = 32, initializer_range: float = 0.2,
               max_position_embeddings: int = 256) -> str:
    """A tiny random Llama (fp32). initializer_range 0.2 makes every layer matter and the
    logits spread (std ~1), so argmax near-ties are rare and the first layers disagree with
    the full model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        initializer_range=initializer_range, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return save_llama(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def llama(llama_dir):
    return load_model(llama_dir)


def draft_proposer(model_dir: str, k: int, method: str = "greedy", **context) -> DraftModelProposer:
    config = SpeculativeConfig(method="draft_model", model=model_dir, num_speculative_tokens=k,
                               draft_sample_method=method)
    context = {"max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN, "vocab_size": VOCAB, **context}
    return build_proposer(config, ProposerContext(**context))


def greedy_reference(model, token_ids: list[int], num_new: int, num_layers=None) -> list[int]:
    """Greedy continuation with a plain runner: prefill, then one token per forward."""
    runner = ModelRunner(model, 1, MAX_MODEL_LEN)
    logits = runner.forward([0], [list(token_ids)], num_layers=num_layers)
    out = []
    for _ in range(num_new):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([0], [[out[-1]]], num_layers=num_layers)
    return out


def reference_logits(model, token_ids: list[int], drafts: list[int], num_layers=None):
    """[n, V] logits that produce d_1..d_n: the context, then d_1..d_{n-1}, fed one by one."""
    runner = ModelRunner(model, 1, MAX_MODEL_LEN)
    rows = [runner.forward([0], [list(token_ids)], num_layers=num_layers)[0]]
    for d in drafts[:-1]:
        rows.append(runner.forward([0], [[d]], num_layers=num_layers)[0])
    return torch.stack(rows)


def split(proposal) -> list[list[int]]:
    cu = proposal.cu_num_draft_tokens.tolist()
    ids = proposal.draft_token_ids.tolist()
    return [ids[cu[r] : cu[r + 1]] for r in range(len(cu) - 1)]


def check_rollback_over_steps(proposer, fresh, k: int, *, num_steps: int = 30, seed: int = 0,
                              target_runner: ModelRunner | None = None) -> None:
    """Simulated steps with random n_r and accept counts. After each ``propose`` and each
    ``on_commit`` the cache length follows the rule; each step's drafts (and q) equal those of
    ``fresh`` started from empty on the same committed context.

    With ``target_runner`` (early exit drafting in the target's rows) the engine's target cache
    is emulated instead: a verify forward over the uncached tokens and the drafts, then a
    rollback to ``num_committed_tokens - 1``; ``propose`` must leave its lengths unchanged.
    """
    rng = random.Random(seed)
    requests = [
        Request([rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))], k, slot=s,
                temperature=[0.8, 1.0, 1.3][s], seed=1000 + s)
        for s in range(3)
    ]
    expected = {r.slot: 0 for r in requests}  # tokens each slot's cache must hold
    seen = set()
    for step in range(num_steps):
        for request in requests:
            request.max_num_draft_tokens = rng.randint(0, k)
        for request in requests:
            fresh.free(request.slot)
        want = fresh.propose(requests)
        if target_runner is not None:
            target_lengths = target_runner.kv_cache.lengths_np.copy()
        got = proposer.propose(requests)
        assert got.cu_num_draft_tokens.tolist() == want.cu_num_draft_tokens.tolist()
        assert got.draft_token_ids.tolist() == want.draft_token_ids.tolist(), f"step {step}"
        if want.draft_probs is not None:
            torch.testing.assert_close(got.draft_probs, want.draft_probs, atol=1e-5, rtol=1e-4)
        drafts = split(got)
        if target_runner is not None:
            assert (target_runner.kv_cache.lengths_np == target_lengths).all()
            feeds = [r.token_ids[target_runner.kv_cache.length(r.slot) :] + d
                     for r, d in zip(requests, drafts)]
            target_runner.forward([r.slot for r in requests], feeds, logits="none")
        for request, draft in zip(requests, drafts):
            if draft:  # the committed tokens plus d_1 .. d_{n_r - 1}
                expected[request.slot] = len(request.token_ids) + len(draft) - 1
            if target_runner is None:
                assert proposer.num_cached_tokens[request.slot] == expected[request.slot]
            # Verification (simulated): zero, all, or a random number of drafts accepted,
            # then a recovered or bonus token.
            accepted = rng.choice([0, len(draft), rng.randint(0, len(draft))])
            kind = "none" if not draft else "all" if accepted == len(draft) else (
                "zero" if accepted == 0 else "some")
            seen.add(kind)
            request.token_ids = request.token_ids + draft[:accepted] + [rng.randrange(VOCAB)]
        committed = [len(r.token_ids) for r in requests]
        proposer.on_commit([r.slot for r in requests], committed)
        for request, num in zip(requests, committed):
            expected[request.slot] = min(expected[request.slot], num - 1)
            if target_runner is None:
                assert proposer.num_cached_tokens[request.slot] == expected[request.slot]
            else:
                target_runner.kv_cache.truncate(request.slot, num - 1)
        if step == num_steps // 2:  # a request finishes; a new one takes its slot
            proposer.free(1)
            if target_runner is not None:
                target_runner.kv_cache.free(1)
            requests[1] = Request([rng.randrange(VOCAB) for _ in range(4)], k, slot=1,
                                  temperature=1.1, seed=77)
            expected[1] = 0
            assert proposer.num_cached_tokens[1] == 0
    assert seen == {"none", "zero", "some", "all"}


def test_registered():
    assert get_proposer_cls("draft_model") is DraftModelProposer
    assert isinstance(Request([1], 1), ProposalRequest)


def test_identical_draft_proposes_target_greedy_continuation(llama_dir, llama):
    """A draft identical to the target drafts the target's greedy continuation; committing all
    k drafts plus the bonus each step keeps it on that continuation (d_k + bonus catch-up)."""
    from transformers import AutoModelForCausalLM

    k, prompt = 4, [1, 17, 5, 33, 8]
    reference = greedy_reference(llama.model, prompt, 3 * (k + 1))
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(len(reference)):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, len(prompt) :].tolist() == reference

    proposer = draft_proposer(llama_dir, k)
    assert proposer.draft_probs_buffer is None and not proposer.uses_draft_probs
    request = Request(list(prompt), k)
    for step in range(3):
        proposal = proposer.propose([request])
        assert proposal.draft_probs is None
        assert proposal.draft_token_ids.dtype == torch.int64
        start = step * (k + 1)
        assert proposal.draft_token_ids.tolist() == reference[start : start + k]
        request.token_ids += reference[start : start + k + 1]  # all accepted + bonus
        proposer.on_commit([0], [len(request.token_ids)])
        assert proposer.num_cached_tokens[0] == len(request.token_ids) - 2  # d_k, bonus unfed


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_rollback_matches_fresh_proposer(llama_dir, method):
    check_rollback_over_steps(draft_proposer(llama_dir, 3, method),
                              draft_proposer(llama_dir, 3, method), 3)


def test_probabilistic_drafts_q_seeds_and_buffer(llama_dir, llama):
    k = 4
    proposer = draft_proposer(llama_dir, k, "probabilistic")
    assert proposer.uses_draft_probs
    buffer = proposer.draft_probs_buffer
    assert buffer.shape == (4, k, VOCAB) and buffer.dtype == torch.float32
    pointer = buffer.data_ptr()
    requests = [Request([3, 9, 27, 4], k, slot=2, temperature=0.7, seed=5),
                Request([50, 1], k, slot=0, temperature=1.5, seed=6),
                Request([8, 8, 8], 2, slot=3, temperature=0.0, seed=7)]  # greedy: argmax
    for step in range(3):
        proposal = proposer.propose(requests)
        assert proposer.draft_probs_buffer.data_ptr() == pointer
        assert proposal.draft_probs.dtype == torch.float32
        for request, drafts, (lo, hi) in zip(
            requests, split(proposal), zip(proposal.cu_num_draft_tokens[:-1].tolist(),
                                           proposal.cu_num_draft_tokens[1:].tolist())
        ):
            logits = reference_logits(llama.model, request.token_ids, drafts)  # [n, V]
            n, num_tokens = len(drafts), len(request.token_ids)
            temperature = torch.full((n,), request.temperature)
            q = torch.softmax(logits / (request.temperature or 1.0), dim=-1)
            torch.testing.assert_close(proposal.draft_probs[lo:hi], q, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(buffer[request.slot, :n], q, atol=1e-6, rtol=1e-5)
            # Each draft is the draft-stream sample at its own absolute position.
            ids, _ = ops.sample_draft(logits, temperature, torch.full((n,), request.seed),
                                      torch.arange(num_tokens, num_tokens + n))
            assert drafts == ids.tolist()
            if request.temperature == 0:
                assert drafts == logits.argmax(-1).tolist()
            request.token_ids = request.token_ids + drafts[: step % 3] + [step + 10]
        proposer.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])

    # Same seeds, same drafts, whatever the batch; another seed changes only its request.
    def drafts_of(batch):
        fresh = draft_proposer(llama_dir, k, "probabilistic")
        return split(fresh.propose(batch))

    base = drafts_of(requests)
    assert drafts_of(requests) == base
    assert drafts_of(requests[:1]) == base[:1]
    reseeded = [Request(requests[0].token_ids, k, slot=2, temperature=0.7, seed=s)
                for s in range(100, 106)]
    outcomes = {tuple(drafts_of([r, *requests[1:]])[0]) for r in reseeded}
    assert len(outcomes) > 1


def test_mixed_batch_one_forward_per_draft_position(llama_dir, llama):
    """n_r = 3, 0, 1, 2 in one batch: each request's drafts equal its greedy continuation (and
    its drafts alone); the batch costs max n_r forwards; the n_r = 0 request is not touched."""
    k = 3
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13], [21, 22, 23]]
    num_drafts = [3, 0, 1, 2]
    requests = [Request(p, n, slot=s) for s, (p, n) in enumerate(zip(prompts, num_drafts))]
    proposer = draft_proposer(llama_dir, k)
    calls = []
    forward = proposer.runner.forward

    def counting_forward(slots, token_ids, *args, **kwargs):
        calls.append((list(slots), [len(t) for t in token_ids]))
        return forward(slots, token_ids, *args, **kwargs)

    proposer.runner.forward = counting_forward
    proposal = proposer.propose(requests)
    assert proposal.cu_num_draft_tokens.tolist() == [0, 3, 3, 4, 6]
    for request, drafts, n in zip(requests, split(proposal), num_drafts):
        assert drafts == greedy_reference(llama.model, request.token_ids, n)
    assert calls == [([0, 2, 3], [5, 1, 3]), ([0, 3], [1, 1]), ([0], [1])]
    assert proposer.num_cached_tokens.tolist() == [7, 0, 1, 4]

    alone = draft_proposer(llama_dir, k)
    for request, drafts in zip(requests, split(proposal)):
        assert split(alone.propose([request]))[0] == drafts

    # Nothing to draft: no forward, an empty proposal.
    calls.clear()
    empty = proposer.propose([Request([1, 2], 0, slot=1)])
    assert calls == [] and empty.draft_token_ids.shape == (0,)
    assert empty.cu_num_draft_tokens.tolist() == [0, 0]


def test_drafts_stop_at_max_model_len(llama_dir):
    proposer = draft_proposer(llama_dir, 4, max_model_len=10)
    proposal = proposer.propose([Request(list(range(8)), 4)])
    assert proposal.cu_num_draft_tokens.tolist() == [0, 2]  # positions 8 and 9 only
    assert proposer.num_cached_tokens[0] == 9


def test_vocab_mismatch_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match=r"vocab_size=64.*vocab_size=100") as error:
        draft_proposer(llama_dir, 2, vocab_size=100)
    assert llama_dir in str(error.value)
    # Without context.vocab_size, the target model's config gives it.
    target = SimpleNamespace(config=SimpleNamespace(vocab_size=65))
    with pytest.raises(ValueError, match=r"vocab_size=64.*vocab_size=65"):
        draft_proposer(llama_dir, 2, vocab_size=None, target_model=target)
    with pytest.raises(ValueError, match="needs the draft model"):
        build_proposer(SpeculativeConfig(method="draft_model"), ProposerContext(vocab_size=VOCAB))


def test_tokenizer_size_mismatch_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    def with_tokenizer(name: str, num_tokens: int) -> str:
        path = save_llama(tmp_path / name, num_layers=1)
        words = {f"w{i}": i for i in range(num_tokens)}
        tokenizer = Tokenizer(WordLevel(words, unk_token="w0"))
        PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
        return path

    draft_dir, target_dir = with_tokenizer("draft", 60), with_tokenizer("target", 50)
    target = load_model(target_dir)
    with pytest.raises(ValueError, match=r"tokenizer of 60 tokens.*has 50") as error:
        draft_proposer(draft_dir, 2, target_model=target)
    assert draft_dir in str(error.value)
    draft_proposer(draft_dir, 2, target_model=load_model(draft_dir))  # same tokenizer: fine


def _flat(proposer: DraftModelProposer) -> DraftModelProposer:
    """The proposer on the GPU path (flat layout, captured draft; on CPU the capture runs
    eagerly on the same static buffers)."""
    ctx = proposer.context
    proposer.runner = ModelRunner(proposer.loaded.model, ctx.max_num_seqs, ctx.max_model_len,
                                  flat_layout=True,
                                  max_step_tokens=proposer.num_speculative_tokens + 1)
    proposer._init_buffers(ctx.max_num_seqs, VOCAB)
    proposer.capture()
    return proposer


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_captured_draft_matches_eager(llama_dir, method):
    """Over simulated steps with random acceptance, the captured k-step draft (catch-up of the
    last two committed tokens) proposes what the eager drafting proposes: the same tokens and,
    for probabilistic drafting, the same q (float32, up to summation order). The first step
    after the prompt feeds the prompt eagerly first (but for its last two tokens), then
    replays."""
    k = 3
    eager = draft_proposer(llama_dir, k, method)
    graph = _flat(draft_proposer(llama_dir, k, method))
    rng = random.Random(0)
    contexts = {0: [5, 9, 11, 3], 2: [7, 1, 22, 40, 41, 8, 2]}
    replays = 0
    for _ in range(6):  # the first step catches the prompt up eagerly, then replays
        requests = [Request(list(c), k, slot, temperature=0.8 if method != "greedy" else 0.0,
                            seed=slot + 10) for slot, c in contexts.items()]
        replays += graph._can_replay(requests, np.arange(2), np.array([0, 2]))
        a, b = eager.propose(requests), graph.propose(requests)
        assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist()
        if method != "greedy":
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-6)
        for r in requests:  # accept a random number of drafts, then a token of our choosing
            drafts = a.draft_token_ids.tolist()[:k] if r.slot == 0 else \
                a.draft_token_ids.tolist()[k:]
            contexts[r.slot] += drafts[:rng.randint(0, k)] + [rng.randrange(VOCAB)]
        for p in (eager, graph):
            p.on_commit(list(contexts), [len(c) for c in contexts.values()])
    assert replays == 6


class _ByteTokenizer:
    """llguidance's view of a vocabulary of VOCAB tokens: EOS, then the bytes 33, 34, ..."""

    eos_token_id = 0
    bos_token_id = None
    special_token_ids = [0]
    tokens = [b"</s>"] + [bytes([32 + i]) for i in range(1, VOCAB)]

    def __call__(self, text: bytes) -> list[int]:
        return [b - 32 for b in bytes(text)]


def _grammar():
    """A fresh matcher of a regex whose masks depend on the walk: a letter, then a digit."""
    compiler = GrammarCompiler(llguidance.LLTokenizer(llguidance.TokenizerWrapper(
        _ByteTokenizer())), VOCAB)
    return compiler.matcher(StructuredOutputsParams(regex="((A|B)[0-9])+"))


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_grammar_batches_replay_the_position_forwards(llama_dir, method):
    """A batch with a grammar drafts between host-side masks; on the flat layout it replays the
    captured forwards of one position (the last two committed tokens, then one draft at a
    time) and proposes what the eager drafting proposes: the same tokens (inside the
    grammar) and q, over steps with random acceptance."""
    k = 3
    eager = draft_proposer(llama_dir, k, method)
    graph = _flat(draft_proposer(llama_dir, k, method))
    assert graph.runner.graphs.has(graph._position_graph(1))
    rng = random.Random(1)
    contexts = {0: [5, 9, 11, 3], 2: [7, 1, 22, 40, 41, 8, 2]}
    replays = 0
    for _ in range(5):
        requests = [Request(list(c), k, slot, temperature=0.8 if method != "greedy" else 0.0,
                            seed=slot + 10) for slot, c in contexts.items()]
        for r in requests:
            r.grammar = _grammar()
        assert not graph._can_replay(requests, np.arange(2), np.array([0, 2]))
        replays += graph._replays_positions(requests, np.arange(2))
        a, b = eager.propose(requests), graph.propose(requests)
        drafts = a.draft_token_ids.tolist()
        assert drafts == b.draft_token_ids.tolist()
        for row in (drafts[:k], drafts[k:]):  # inside the grammar
            assert _grammar().num_valid(row) == k, row
        if method != "greedy":
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-6)
        for r in requests:
            row = drafts[:k] if r.slot == 0 else drafts[k:]
            contexts[r.slot] += row[:rng.randint(0, k)] + [rng.randrange(VOCAB)]
        for p in (eager, graph):
            p.on_commit(list(contexts), [len(c) for c in contexts.values()])
    assert replays == 5


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_drafting_ahead_matches_drafting_after_the_commit(llama_dir, method):
    """The next step's draft queued from a step's output tokens (device tensors the host has not
    read, -1 padded) equals what the eager proposer drafts after the commit, over steps that
    accept no draft, some and all; the queued drafts are used when the same requests continue,
    and a step whose batch changed (a request left) or whose requests took another step in
    between drafts as usual, with the same tokens."""
    k = 3
    eager = draft_proposer(llama_dir, k, method)
    graph = _flat(draft_proposer(llama_dir, k, method))
    taken = []
    take = graph._take_ahead
    graph._take_ahead = lambda requests: taken.append(take(requests)) or taken[-1]
    temperature = 0.0 if method == "greedy" else 0.8
    requests = [Request([5, 9, 11, 3], k, 0, temperature, 10),
                Request([7, 1, 22, 40, 41, 8, 2], k, 2, temperature, 11),
                Request([4, 4, 6], k, 1, temperature, 12)]
    rng = random.Random(3)
    for step in range(9):
        if step == 6:
            requests = requests[:2]  # the third finished: the queued drafts are not used
        if step == 7:  # both took a plain step after the queued drafts: not used either
            for r in requests:
                r.token_ids.append(rng.randrange(VOCAB))
            for p in (eager, graph):
                p.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])
        a, b = eager.propose(requests), graph.propose(requests)
        assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist(), step
        if method != "greedy":
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-6)
        drafts = a.draft_token_ids.view(len(requests), k).tolist()
        outputs = torch.full((len(requests), k + 1), -1, dtype=torch.int32)
        for i in range(len(requests)):
            accepted = (0, k, rng.randint(0, k))[(step + i) % 3]
            tokens = drafts[i][:accepted] + [rng.randrange(VOCAB)]
            outputs[i, :len(tokens)] = torch.tensor(tokens)
        graph.draft_ahead(requests, outputs)  # before the host commits
        for i, r in enumerate(requests):
            r.token_ids += [t for t in outputs[i].tolist() if t != -1]
        for p in (eager, graph):
            p.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])
    assert taken == [False, True, True, True, True, True, False, False, True]


def test_captured_draft_refuses_swapped_buffers(llama_dir):
    """A buffer replaced after capture would never be written by a replay (the drafts would be
    stale): the proposer refuses to replay instead."""
    proposer = _flat(draft_proposer(llama_dir, 2, "probabilistic"))
    requests = [Request([5, 9, 11, 3], 2, 0, temperature=1.0)]
    proposer.propose(requests)
    proposer.on_commit([0], [5])
    requests[0].token_ids.append(4)
    proposer.draft_probs_buffer = torch.zeros_like(proposer.draft_probs_buffer)
    with pytest.raises(RuntimeError, match="replaced after the CUDA graph was captured"):
        proposer.propose(requests)


def _save_word_tokenizer(path, words: list[str]) -> None:
    """A word-level tokenizer over ``words`` (ids in order) next to a model's weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0]).save_pretrained(path)


def test_draft_tokenizer_is_checked_in_a_running_engine(tmp_path):
    """Regression: the engine gave the proposer no tokenizer, so the draft/target tokenizer
    check never ran outside unit tests. A draft whose tokenizer has the target's size but other
    tokens is refused by ``LLM``; one with the same tokenizer runs."""
    from verispec import LLM

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    target = save_llama(tmp_path / "target", num_layers=2)
    same = save_llama(tmp_path / "same", num_layers=1, seed=1)
    other = save_llama(tmp_path / "other", num_layers=1, seed=2)
    _save_word_tokenizer(target, words)
    _save_word_tokenizer(same, words)
    _save_word_tokenizer(other, words[:-1] + ["zz"])
    spec = {"method": "draft_model", "num_speculative_tokens": 2}
    llm = LLM(target, dtype="float32", speculative_config={**spec, "model": same})
    assert llm.generate(["w1 w2 w3"], {"max_tokens": 4, "ignore_eos": True})[0].token_ids
    with pytest.raises(ValueError, match=r"tokenizer of the target's size whose tokens differ"):
        LLM(target, dtype="float32", speculative_config={**spec, "model": other})
