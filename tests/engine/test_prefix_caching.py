"""Prefix caching and chunked prefill (docs/design.md §13): the block pool's published blocks
(hash chain, LRU eviction, reference counts), and through the engine on CPU the invariance
rule: a request's tokens are the same cold, after a prefix-cache hit of any length, with any
chunk size, alone or batched, with or without speculation (greedy speculation is the plain
greedy output), in float32 and bfloat16; seeded sampling too.

The comparisons are exact (``==`` on token lists): batch invariance and per-request seeds make
them so. A hit must never return KV written by a rejected draft: a random draft model (whose
drafts the target rejects almost always) writes the blocks a later request finds.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_preemption import (
    VOCAB,
    save_draft,
    save_head,
    save_target,
    speculative_config,
)
from verispec import LLM, SamplingParams
from verispec.engine.scheduler import attention_pairs
from verispec.runtime.block_pool import BlockPool
from verispec.runtime.kv_cache import BlockTables
from verispec.runtime.prefix_cache import PrefixCache, extend_keys

MAX_MODEL_LEN = 160
BLOCK_SIZE = 4


# ----------------------------------------------------------------- the block pool


def test_published_blocks_are_found_by_their_chain_and_evicted_least_recent_first():
    pool = BlockPool(6)  # blocks 1..5
    a, b, c = pool.allocate(3)
    keys = extend_keys([], np.arange(12), 4, 3)
    for block, key in zip((a, b, c), keys):
        pool.publish(block, key)
    assert pool.lookup(keys) == [a, b, c]
    # a chain: the same tokens after a different first block are another key
    other = extend_keys([], np.concatenate([[99, 1, 2, 3], np.arange(4, 12)]), 4, 3)
    assert other[1] != keys[1] and pool.lookup(other) == []
    assert pool.lookup(keys[:2] + other[2:]) == [a, b]
    # freed last first: the deepest block is the oldest free one after the never-used ones
    pool.free([c, b, a])
    assert pool.num_free == 5 and pool.lookup(keys) == [a, b, c]  # still cached when free
    pool.touch([a, b])  # a hit takes them back
    assert pool.ref_counts[a] == pool.ref_counts[b] == 1 and pool.num_free == 3
    # allocation takes never-used blocks first, then the least recently freed: c, evicting it
    fresh = pool.allocate(3)
    assert c in fresh and pool.lookup(keys) == [a, b]
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.allocate(1)
    # shared blocks: two holders, freed twice before they are free
    pool.touch([a])
    pool.free([a])
    assert pool.ref_counts[a] == 1 and a not in pool._free
    pool.free([a, b])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    with pytest.raises(ValueError, match="free KV block"):
        pool.publish(a, b"x" * 16)
    pool.reset_prefix_cache()
    assert pool.lookup(keys) == [] and pool.num_cached == 0


def test_a_key_stays_with_the_first_block_that_published_it():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    key = extend_keys([], np.arange(4), 4, 1)[0]
    pool.publish(a, key)
    pool.publish(b, key)  # computed twice at once: b stays an ordinary block
    assert pool.lookup([key]) == [a]
    pool.free([b])
    assert pool.lookup([key]) == [a]


class _Request:
    def __init__(self, slot, tokens):
        self.slot, self.block_keys = slot, []
        self.token_ids = np.asarray(tokens)
        self.num_tokens = len(tokens)


def keys_of(request, n):
    return extend_keys([], request.token_ids, 4, n)


class _Cache:
    def __init__(self, lengths, owns_blocks):
        self.lengths_np, self.owns_blocks = np.asarray(lengths), owns_blocks

    def set_lengths(self, slots, lengths):
        self.lengths_np[slots] = lengths


def test_blocks_are_published_as_the_target_commits_them_and_complete_when_all_caches_do():
    tables = BlockTables(BlockPool(16), num_slots=2, max_blocks=8, block_size=4)
    # the target's cache, a draft model's that lags behind it
    target, draft = _Cache([11, 0], True), _Cache([6, 0], False)
    for cache in (target, draft):
        tables.add_cache(cache)
    assert tables.reserve(0, 16)
    prefix = PrefixCache(tables)
    request = _Request(0, list(range(3, 16)))  # 13 committed tokens
    prefix.publish([request])
    blocks = tables.blocks(0)
    assert tables.num_published_np[0] == 2 and tables.num_complete_np[0] == 1
    assert tables.pool.complete[blocks[:2]].tolist() == [True, False]
    # a hit: the target takes both blocks, the draft starts after the complete one
    other = _Request(1, list(range(3, 16)))
    hit = prefix.lookup(other, 13)
    assert hit == blocks[:2]
    tables.assign(1, hit)
    prefix.start_lengths(1, 8)
    assert target.lengths_np[1] == 8 and draft.lengths_np[1] == 4
    # a proposer whose rows depend on the next token: complete blocks completed before the
    # request's own next token
    shifted = PrefixCache(tables, shifted=True)
    assert shifted.lookup(other, 13) == blocks[:1]
    assert tables.pool.next_token[blocks[0]] == 7  # token 4 of the request that completed it
    draft.lengths_np[0] = 12
    prefix.publish([request])
    assert tables.num_complete_np[0] == 2  # 11 // 4: position 11 is not committed in all
    assert shifted.lookup(other, 13) == blocks[:2]
    # the same first block followed by another token: its last row is not this request's
    diverging = _Request(1, list(range(3, 7)) + [50] + list(range(8, 16)))
    assert shifted.lookup(diverging, 13) == []
    # ... until a request with that next token completes a copy of the block
    tables.release(1)
    assert tables.reserve(1, 8)
    copy = tables.blocks(1)
    assert not set(copy) & set(blocks)
    target.lengths_np[1] = draft.lengths_np[1] = 8
    prefix.publish([_Request(1, list(range(3, 7)) + [50, 51, 52, 53, 54])])
    assert tables.pool.lookup(keys_of(diverging, 1)) == blocks[:1]  # the key stays published
    assert shifted.lookup(diverging, 13) == copy[:1]
    tables.release(1)
    assert tables.pool.allocate(tables.pool.num_free)  # evicts every free block's keys
    assert shifted.lookup(diverging, 13) == []
    # a hit leaves at least one token to compute
    assert prefix.lookup(_Request(1, list(range(3, 11))), 8) == blocks[:1]


# ----------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_draft(tmp_path_factory, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return save_head(target_dir, tmp_path_factory)


def workload():
    """Prompts that share a first part of 0 .. 33 tokens with the first prompt (hits of 0 .. 8
    blocks of 4, one ending mid-block, one prompt a prefix of another), greedy and seeded."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, VOCAB, size=33).tolist()
    prompts = [shared + rng.integers(3, VOCAB, size=6).tolist()]
    for cut in (0, 4, 9, 16, 33, 33):
        prompts.append(shared[:cut] + rng.integers(3, VOCAB, size=5 + cut % 7).tolist())
    prompts.append(shared[:21])
    params = [SamplingParams(max_tokens=24, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.9, seed=40 + i)
              for i in range(len(prompts))]
    return prompts, params


def make_llm(target_dir, spec=None, dtype="float32", **kwargs):
    return LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
               speculative_config=spec, block_size=BLOCK_SIZE, **kwargs)


@pytest.fixture(scope="module")
def cold(target_dir):
    """Each request alone, no prefix cache, no chunks: the reference tokens per dtype."""
    prompts, params = workload()
    result = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(target_dir, dtype=dtype, enable_prefix_caching=False,
                       enable_chunked_prefill=False)
        result[dtype] = [llm.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    return result


def warm_then_rest(llm):
    """The first prompt alone (it publishes the shared blocks), then all of them batched:
    every one but the unrelated prompt hits."""
    prompts, params = workload()
    first = llm.generate([prompts[0]], [params[0]])[0]
    outputs = llm.generate(prompts, params)
    assert outputs[0].token_ids == first.token_ids
    return outputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 3, 8, 64])
def test_prefix_hits_and_chunks_give_the_cold_tokens(dtype, chunk, target_dir, cold):
    llm = make_llm(target_dir, dtype=dtype, max_num_batched_tokens=chunk)
    outputs = warm_then_rest(llm)
    for i, out in enumerate(outputs):
        assert out.token_ids == cold[dtype][i], f"request {i}"
    cached = [o.num_cached_tokens for o in outputs]
    # hits of every length in blocks: the shared part's full blocks (one token left to compute)
    assert cached == [36, 0, 4, 8, 16, 32, 32, 20]
    metrics = llm.get_metrics()["prefix_cache"]
    assert metrics["hits"] >= sum(cached) and metrics["queries"] > metrics["hits"]
    pool = llm.runner.kv_cache.pool
    assert pool.num_free == pool.num_usable  # every block back (published ones stay cached)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
@pytest.mark.parametrize("chunk", [3, 64])
def test_greedy_speculation_with_hits_and_chunks_is_plain_greedy(method, chunk, target_dir,
                                                                 draft_dir, head_dir, cold):
    spec = speculative_config(method, draft_dir, head_dir)
    llm = make_llm(target_dir, spec, max_num_batched_tokens=chunk)
    outputs = warm_then_rest(llm)
    _, params = workload()
    for i, out in enumerate(outputs):
        if params[i].temperature == 0.0:
            assert out.token_ids == cold["float32"][i], f"request {i}"
    assert outputs[5].num_cached_tokens == 32
    # the shared part is not a multiple of the block: every block of it is followed by the
    # same token, whichever request completed it
    assert outputs[6].num_cached_tokens == 32


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_seeded_speculative_tokens_do_not_change_with_hits_or_chunks(method, target_dir,
                                                                     draft_dir, head_dir):
    spec = speculative_config(method, draft_dir, head_dir)
    prompts, params = workload()
    plain = make_llm(target_dir, spec, enable_prefix_caching=False,
                     enable_chunked_prefill=False)
    expected = [plain.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    outputs = warm_then_rest(make_llm(target_dir, spec, max_num_batched_tokens=5))
    for i, out in enumerate(outputs):
        assert out.token_ids == expected[i], f"request {i}"


def test_hits_on_blocks_written_while_drafts_were_rejected(target_dir, draft_dir, cold):
    """A chat's second turn extends the first turn's prompt and answer: its hit covers blocks
    the first turn filled while decoding, where a random draft model's drafts were rejected
    nearly every step (rows past the committed length held rejected drafts). The second turn
    must get exactly its cold tokens."""
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = make_llm(target_dir, spec)
    reference = make_llm(target_dir, enable_prefix_caching=False)
    prompts, _ = workload()
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    first = llm.generate([prompts[1]], params)[0]
    stats = first.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens / 2
    turn = prompts[1] + first.token_ids + [5, 6, 7]
    second = llm.generate([turn], params)[0]
    assert second.num_cached_tokens >= len(prompts[1]) + 40 - 2 * BLOCK_SIZE
    assert second.token_ids == reference.generate([turn], params)[0].token_ids


def test_the_second_turn_skips_the_prefill_of_the_first(target_dir, monkeypatch):
    """The CPU engine: the second turn's forwards feed only the tokens after the hit."""
    llm = make_llm(target_dir)
    prompts, _ = workload()
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    first = llm.generate([prompts[0]], params)[0]
    fed = []
    forward = llm.runner.forward

    def counting_forward(slots, token_ids, *args, **kwargs):
        fed.append(sum(len(t) for t in token_ids))
        return forward(slots, token_ids, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", counting_forward)
    turn = prompts[0] + first.token_ids + [9, 8, 7, 6]
    second = llm.generate([turn], params)[0]
    prefill = fed[0]
    # the first turn's committed tokens but its last (never fed), in full blocks
    assert second.num_cached_tokens == (len(prompts[0]) + 12 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert prefill == len(turn) - second.num_cached_tokens < 2 * BLOCK_SIZE
    off = make_llm(target_dir, enable_prefix_caching=False)
    assert second.token_ids == off.generate([turn], params)[0].token_ids


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(target_dir, cold):
    llm = make_llm(target_dir, max_num_batched_tokens=8)
    prompts, params = workload()
    streams = [llm.add_request(p, q) for p, q in zip(prompts[1:4], params[1:4])]
    for _ in range(6):
        llm.step()
    assert all(r.num_output_tokens > 0 for r in streams)
    long_prompt = prompts[0] * 3  # 117 tokens: 15 steps of 8 minus the decodes' share
    late = llm.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True, seed=7))
    counts = []
    while late.is_prefilling or late.num_output_tokens == 0:
        before = [r.num_output_tokens for r in streams]
        llm.step()
        counts.append([r.num_output_tokens - b for r, b in zip(streams, before)])
    assert len(counts) > 10  # many chunks
    for step in counts:  # every running stream got its token in every one of them
        assert all(c == 1 for c, r in zip(step, streams) if not r.finished or c)
    while llm.has_unfinished_requests:
        llm.step()
    for i, r in enumerate(streams):
        assert r.output_token_ids.tolist() == cold["float32"][i + 1]
    alone = make_llm(target_dir, enable_prefix_caching=False, enable_chunked_prefill=False)
    assert late.output_token_ids.tolist() == alone.generate(
        [long_prompt], SamplingParams(max_tokens=4, ignore_eos=True, seed=7))[0].token_ids


def test_an_attention_budget_cuts_chunks_deep_in_a_long_prompt(target_dir, cold):
    """``prefill_attention_budget``: while others decode, each chunk of a long prompt attends at
    most the budget's (query, key) pairs, so its chunks shrink as its context grows (the
    first, near position 0, may take the whole token budget); alone it takes the token budget;
    every token equals the unchunked run's."""
    budget = 400
    llm = make_llm(target_dir, max_num_batched_tokens=32, prefill_attention_budget=budget,
                   enable_prefix_caching=False)
    prompts, params = workload()
    streams = [llm.add_request(p, q) for p, q in zip(prompts[1:4], params[1:4])]
    for _ in range(4):
        llm.step()
    long_prompt = prompts[0] * 3
    late = llm.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True, seed=7))
    chunks = []
    while late.is_prefilling or late.num_output_tokens == 0:
        start = late.num_computed_tokens
        decoding = any(not r.finished for r in streams)
        llm.step()
        if late.num_computed_tokens > start:
            chunks.append((start, late.num_computed_tokens - start, decoding))
    for start, n, decoding in chunks:
        if decoding:
            assert attention_pairs(start, n) <= budget or n == 1, (start, n)
    deep = [n for start, n, decoding in chunks if decoding and start >= 60]
    assert deep and max(deep) < 32 - 3  # cut below what the token budget leaves
    while llm.has_unfinished_requests:
        llm.step()
    for i, r in enumerate(streams):
        assert r.output_token_ids.tolist() == cold["float32"][i + 1]
    alone = make_llm(target_dir, enable_prefix_caching=False, enable_chunked_prefill=False)
    late_params = SamplingParams(max_tokens=4, ignore_eos=True, seed=7)
    assert late.output_token_ids.tolist() == alone.generate([long_prompt],
                                                            late_params)[0].token_ids
    # nobody decoding: the token budget alone
    solo = make_llm(target_dir, max_num_batched_tokens=32, prefill_attention_budget=budget,
                    enable_prefix_caching=False)
    request = solo.add_request(long_prompt, late_params)
    solo.step()
    assert request.num_computed_tokens == 32
    with pytest.raises(ValueError, match="prefill_attention_budget must be an integer >= 1"):
        make_llm(target_dir, prefill_attention_budget=0)


def test_feature_flags_are_checked(target_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        make_llm(target_dir, enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True or False"):
        make_llm(target_dir, enable_chunked_prefill=1)
    llm = make_llm(target_dir, enable_prefix_caching=False, enable_chunked_prefill=False)
    assert llm.get_metrics()["prefix_cache"] is None
    assert llm.max_num_batched_tokens == 8192
    assert make_llm(target_dir).max_num_batched_tokens == 2048


def test_a_shared_prompt_ending_on_a_block_gives_eagle_the_cold_drafts(target_dir, head_dir):
    """Conversations share a system prompt of whole blocks, then differ: the head's last row of
    the prompt's last block pairs it with the next token, which differs by conversation. Under
    synthetic acceptance the output is whichever drafts pass, so any head row taken from
    another conversation would change it: outputs with caching equal those without."""
    spec = speculative_config("eagle3", None, head_dir)
    spec.update(rejection_sample_method="synthetic", synthetic_acceptance_length=2.5)
    rng = np.random.default_rng(9)
    system = rng.integers(3, VOCAB, size=8 * BLOCK_SIZE).tolist()
    users = [[rng.integers(3, VOCAB, size=6).tolist() for _ in range(2)] for _ in range(3)]
    results = []
    for caching in (True, False):
        llm = make_llm(target_dir, spec, enable_prefix_caching=caching)
        history = [list(system) for _ in users]
        outputs = []
        for turn in range(2):
            prompts = [h + u[turn] for h, u in zip(history, users)]
            params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0,
                                     seed=10 * c + turn) for c in range(len(users))]
            done = []
            for prompt, p in zip(prompts, params):  # one at a time: each hits the others'
                done.append(llm.generate([prompt], [p])[0])
            outputs.append([o.token_ids for o in done])
            history = [pr + o.token_ids for pr, o in zip(prompts, done)]
        results.append(outputs)
        if caching:
            # past the system prompt, whose last block conversation 0 completed before another
            # token: conversation 1 finds its own copy of it
            assert done[1].num_cached_tokens > len(system)
    assert results[0] == results[1]


def test_an_eagle_head_that_stopped_drafting_still_completes_its_blocks(target_dir, head_dir):
    """A random head's drafts fail, so the planner turns drafting off for the request; the head
    still takes its pending pairs every CATCH_UP_PENDING steps, so the next turn finds the
    first turn's blocks complete (an EAGLE hit needs the head's rows) and answers as a cold
    engine does."""
    from verispec.proposers.eagle import CATCH_UP_PENDING

    spec = speculative_config("eagle3", None, head_dir)
    llm = make_llm(target_dir, spec)
    prompts, _ = workload()
    first = llm.generate([prompts[1]], SamplingParams(max_tokens=100, ignore_eos=True,
                                                      temperature=0.0))[0]
    assert first.spec_stats.num_draft_tokens < 20  # drafting was switched off early
    turn = prompts[1] + first.token_ids + [5, 6, 7]
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    second = llm.generate([turn], params)[0]
    assert second.num_cached_tokens >= len(turn) - 3 - CATCH_UP_PENDING - BLOCK_SIZE
    cold = make_llm(target_dir, spec, enable_prefix_caching=False)
    assert second.token_ids == cold.generate([turn], params)[0].token_ids
