"""The GPU engine (CUDA graphs, flat layout, Triton model ops) end to end, on a CUDA device.

Strategy: tiny random Llama targets and drafts (logits spread enough that greedy argmax ties are
rare). Every check compares two runs that must agree token for token: graphs against
``enforce_eager``; greedy speculation (draft model, early exit, n-gram; greedy and
probabilistic drafting) against greedy plain decoding, in bfloat16 and float32 (docs/design.md §12);
a request alone against the same request in a batch of 8 (another graph bucket), greedy and
seeded sampling; the captured draft against the eager draft for tokens and q. Skipped without
CUDA (CPU CI runs the same logic through the torch twins in test_flat_runner.py and
tests/proposers/test_draft_model.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.proposers.test_draft_model import Request, save_llama
from verispec import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 512


def _save(path, layers: int, hidden: int, seed: int) -> str:
    return save_llama(path, num_layers=layers, vocab_size=VOCAB, seed=seed, hidden_size=hidden,
                      initializer_range=0.1, max_position_embeddings=512)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return (_save(tmp_path_factory.mktemp("target"), 4, 128, 0),
            _save(tmp_path_factory.mktemp("draft"), 2, 64, 1))


@pytest.fixture(scope="module")
def heads(dirs, tmp_path_factory) -> dict[str, str]:
    """Random EAGLE-3 (a reduced draft vocabulary of 200) and EAGLE-1 heads for the target."""
    from tests.proposers.test_eagle_loader import eagle_checkpoint, write_checkpoint
    from verispec.models import load_model

    target = load_model(dirs[0]).config
    out = {}
    for method in ("eagle3", "eagle"):
        config, state = eagle_checkpoint(method, target, seed=5, scale=0.1,
                                         draft_vocab_size=200 if method == "eagle3" else None)
        out[method] = write_checkpoint(tmp_path_factory.mktemp(method), config, state)
    return out


PROMPTS = [[5 + i, 17, 33 + 2 * i, 90, 11 + i] for i in range(8)]


def _generate(llm: LLM, prompts, **params) -> list[list[int]]:
    params = SamplingParams(max_tokens=40, ignore_eos=True, **params)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _spec(dirs, method: str, draft: str = "greedy", heads: dict | None = None) -> dict:
    config = {"method": method, "num_speculative_tokens": 3, "draft_sample_method": draft}
    if method == "draft_model":
        config["model"] = dirs[1]
    elif method in ("eagle", "eagle3"):
        config["model"] = heads[method]
    elif method == "early_exit":
        config["num_draft_layers"] = 2
    elif method == "ngram":
        config.pop("draft_sample_method")
    return config


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graphs_match_eager_and_greedy_spec_matches_plain(dirs, heads, dtype):
    plain = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8)
    assert plain.runner.graphs is not None and plain.runner.graphs.capture_time_s > 0
    reference = _generate(plain, PROMPTS, temperature=0.0)
    eager = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8, enforce_eager=True)
    assert eager.runner.graphs is None
    assert _generate(eager, PROMPTS, temperature=0.0) == reference
    for method, draft in [("draft_model", "greedy"), ("draft_model", "probabilistic"),
                          ("early_exit", "greedy"), ("early_exit", "probabilistic"),
                          ("ngram", None), ("eagle3", "greedy"),
                          ("eagle3", "probabilistic"), ("eagle", "greedy")]:
        spec = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8,
                   speculative_config=_spec(dirs, method, draft or "greedy", heads))
        assert _generate(spec, PROMPTS, temperature=0.0) == reference, (method, draft)
        if method.startswith("eagle"):  # the target's graphs replay with the head on
            assert spec.spec.stats.num_drafts > 0, (method, draft)
            assert spec.runner.graphs is not None and spec.spec.proposer.runner.graphs.has(
                "draft")


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.9, seed=7),
                                    dict(temperature=0.9, top_p=0.9, seed=3)])
def test_request_alone_equals_request_in_a_batch(dirs, params):
    """Batch 1 (bucket 1) and batch 8 (bucket 8), with speculation: same tokens; and the same
    request twice: same tokens."""
    llm = LLM(dirs[0], device="cuda", max_num_seqs=8,
              speculative_config=_spec(dirs, "draft_model", "probabilistic"))
    alone = _generate(llm, PROMPTS[:1], **params)[0]
    assert _generate(llm, PROMPTS[:1], **params)[0] == alone
    assert _generate(llm, PROMPTS, **params)[0] == alone


@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
def test_captured_draft_writes_tokens_and_probs(dirs, method):
    """The captured k-step draft equals the eager draft (tokens and q), and a draft-probs buffer
    swapped after capture is refused, not silently left unwritten. Early exit drafts in the
    target's own cache rows (its first step feeds the prompt through the drafting layers)."""
    llm = LLM(dirs[0], device="cuda", max_num_seqs=4, dtype="float32",
              speculative_config=_spec(dirs, method, "probabilistic"))
    proposer = llm.spec.proposer
    assert proposer.runner.graphs.has(proposer.graph_name)
    eager = LLM(dirs[0], device="cuda", max_num_seqs=4, dtype="float32", enforce_eager=True,
                speculative_config=_spec(dirs, method, "probabilistic")).spec.proposer
    requests = [Request([5, 9, 11, 3], 3, 0, 0.8, 1), Request([7, 1, 22, 40, 41], 3, 2, 0.8, 2)]
    for p in (proposer, eager):
        p.propose(requests)  # first step: the prompt, eagerly
        p.on_commit([0, 2], [5, 6])
    for r, t in zip(requests, (4, 8)):
        r.token_ids.append(t)
    assert proposer._can_replay(requests, np.arange(2), np.array([0, 2]))
    a, b = eager.propose(requests), proposer.propose(requests)
    assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist()
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-6)
    proposer.draft_probs_buffer = torch.zeros_like(proposer.draft_probs_buffer)
    with pytest.raises(RuntimeError, match="replaced after the CUDA graph was captured"):
        proposer.propose(requests)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_captured_eagle_draft_writes_tokens_and_probs(dirs, heads, method):
    """The captured EAGLE draft (pending pairs from a replayed verify graph, padded to k + 1)
    equals the eager draft for tokens and q over several steps of mixed acceptance; a swapped
    draft-probs buffer is refused."""
    llms = [LLM(dirs[0], device="cuda", max_num_seqs=4, dtype="float32", enforce_eager=eager,
                speculative_config=_spec(dirs, method, "probabilistic", heads))
            for eager in (False, True)]
    proposers = [llm.spec.proposer for llm in llms]
    assert proposers[0].runner.graphs.has("draft") and proposers[1].runner.graphs is None
    rng = np.random.default_rng(0)
    requests = [[Request([5, 9, 11, 3], 3, 0, 0.8, 1), Request([7, 1, 22, 40, 41], 3, 2, 0.8, 2)]
                for _ in llms]
    for llm, reqs, p in zip(llms, requests, proposers):  # the engine's prefill
        llm.runner.forward([0, 2], [r.token_ids for r in reqs])
        for r, t in zip(reqs, (4, 8)):
            r.token_ids.append(t)
            llm.runner.kv_cache.truncate(r.slot, len(r.token_ids) - 1)
        p.on_commit([0, 2], [5, 6])
    for step in range(6):
        out = []
        for llm, reqs, p in zip(llms, requests, proposers):
            proposal = p.propose(reqs)
            llm.runner.verify([0, 2], [r.token_ids[-1] for r in reqs], proposal.draft_token_ids,
                              proposal.num_draft_tokens_cpu)
            out.append(proposal)
        a, b = out
        assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist(), step
        torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-6)
        drafts = a.draft_token_ids.view(2, 3).tolist()
        accepted = [int(x) for x in rng.integers(0, 4, size=2)]
        recovered = [int(x) for x in rng.integers(0, VOCAB, size=2)]
        for llm, reqs, p in zip(llms, requests, proposers):
            for r, d, n, t in zip(reqs, drafts, accepted, recovered):
                r.token_ids += d[:n] + [t]
                llm.runner.kv_cache.truncate(r.slot, len(r.token_ids) - 1)
            p.on_commit([0, 2], [len(r.token_ids) for r in reqs])
    proposers[0].draft_probs_buffer = torch.zeros_like(proposers[0].draft_probs_buffer)
    with pytest.raises(RuntimeError, match="replaced after the CUDA graph was captured"):
        proposers[0].propose(requests[0])


def test_sampler_state_is_never_made_inside_a_capture(dirs, monkeypatch):
    """The samplers' launch plans and scratch (kept between calls, keyed by stream) are made by
    the warm-up on the capture stream, never during a capture: there they would come from the
    memory pool every graph shares, where another graph's temporaries can overwrite them."""
    from verispec.ops import triton_ops

    made, scratch = [], triton_ops._scratch

    def recording(device, stream, *sizes):
        before = triton_ops._SCRATCH.get((device, stream))
        out = scratch(device, stream, *sizes)
        if out is not before:
            made.append(torch.cuda.is_current_stream_capturing())
        return out

    monkeypatch.setattr(triton_ops, "_scratch", recording)
    monkeypatch.setattr(triton_ops, "_SCRATCH", {})
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    LLM(dirs[0], device="cuda", max_num_seqs=4,
        speculative_config=_spec(dirs, "draft_model", "probabilistic"))
    assert made and not any(made), made


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_measured_costs_and_synthetic_mode(dirs, heads, method):
    llm = LLM(dirs[0], device="cuda", max_num_seqs=4, speculative_config={
        "method": method, "model": dirs[1] if method == "draft_model" else heads[method],
        "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.5})
    costs = llm.spec.costs
    assert costs[0] == 1.0 and len(set(costs[1:])) == 1 and costs[1] >= 1.0
    proposer, taken = llm.spec.proposer, []
    take = proposer._take_ahead
    proposer._take_ahead = lambda requests: taken.append(take(requests)) or taken[-1]
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=64, ignore_eos=True))
    assert all(len(o.token_ids) == 64 for o in outs)
    assert 2.2 < llm.spec.stats.mean_acceptance_length < 2.8
    # every step drafted ahead but the first and those after a request finished (3 at most;
    # a head's first step after the prompt drafts as usual too)
    assert taken[0] is False and len(taken) > 10 and taken.count(False) <= 4, taken


def _compiled_variants() -> int:
    """Kernel variants Triton has compiled so far for the samplers' launches."""
    from verispec.ops import triton_kernels_finish, triton_kernels_rows

    device = torch.cuda.current_device()
    return sum(len(kernel.device_caches[device][0]) for kernel in
               (triton_kernels_rows._rows_kernel, triton_kernels_finish._finish_kernel))


@pytest.mark.parametrize("spec", [None, "synthetic"])
def test_no_kernel_compiles_mid_generation(dirs, spec):
    """The samplers are warmed up at start-up for every graph bucket: a batch that shrinks as its
    requests finish (batch sizes 8 down to 1, greedy and sampled, with and without
    speculation) compiles no kernel variant while it generates."""
    config = None if spec is None else {
        "method": "draft_model", "model": dirs[1], "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    llm = LLM(dirs[0], device="cuda", max_num_seqs=8, speculative_config=config)
    before = _compiled_variants()
    for temperature in (0.0, 0.8):
        params = [SamplingParams(max_tokens=4 + 5 * i, ignore_eos=True, temperature=temperature,
                                 seed=i) for i in range(8)]
        llm.generate(PROMPTS, params)
    assert _compiled_variants() == before


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_no_attention_variant_compiles_in_mixed_steps(dirs, spec):
    """Prefill chunks beside decodes (requests of 40 tokens arriving together, 64 tokens a step,
    every batch size from 1 to 18, one a multiple of 16) compile no attention kernel variant
    after start-up (``ModelRunner.warm_up_kernels``), for the target and a draft model."""
    from verispec.ops.triton_attention_kernels import _rope_attention_kernel

    config = None if spec is None else {"method": spec, "model": dirs[1],
                                        "num_speculative_tokens": 3}
    llm = LLM(dirs[0], device="cuda", max_num_seqs=32, max_num_batched_tokens=64,
              speculative_config=config)
    device = torch.cuda.current_device()
    before = len(_rope_attention_kernel.device_caches[device][0])
    prompts = [[(7 * i + j) % VOCAB for j in range(40)] for i in range(18)]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(_rope_attention_kernel.device_caches[device][0]) == before


def test_head_dim_below_16_is_one_clear_error(tmp_path):
    """The GPU attention kernel multiplies 16 features at a time: a model with head_dim 8 is
    refused at construction, naming head_dim (not a Triton compile error at the first step)."""
    path = save_llama(tmp_path, num_layers=1, vocab_size=VOCAB, hidden_size=32)  # 4 heads of 8
    with pytest.raises(ValueError, match="head_dim=8"):
        LLM(path, device="cuda", max_num_seqs=2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("method", [None, "draft_model", "eagle3"])
def test_preempted_and_pieced_requests_keep_their_tokens(dirs, heads, dtype, method):
    """On the GPU (paged Triton attention, graphs over block tables): a pool of a few blocks more
    than one full-length request forces preemptions, and prefills of at most 16 tokens a forward
    split every prompt; greedy and seeded tokens equal those of an unpressured engine."""
    spec = None if method is None else _spec(dirs, method, "probabilistic", heads)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 40, 17, 60, 9, 33, 25, 50)]
    params = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=i) for i in range(8)]
    free = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8, max_model_len=128,
               block_size=16, speculative_config=spec)
    expected = [o.token_ids for o in free.generate(prompts, params)]
    per_block = free.kv_plan.bytes_per_block
    costs = None if method is None else free.spec.costs
    del free
    tight = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8, max_model_len=128,
                block_size=16, kv_cache_memory=(1 + 8 + 4) * per_block,
                max_num_batched_tokens=16, speculative_config=spec)
    if costs is not None:
        # The planner's step costs are timed at start-up; the number of drafts it plans (and so
        # a sampled request's tokens) follows them: give both engines the same.
        tight.spec.costs = costs
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    pool = tight.runner.kv_cache.pool
    assert pool.num_free == pool.num_usable


def test_memory_plan_on_cuda(dirs):
    """The default plan gives the pool what utilization leaves (capped where no more could be
    used) and says so; impossible flags are one clear error each, never a CUDA OOM."""
    llm = LLM(dirs[0], device="cuda", max_num_seqs=4)
    assert llm.max_num_seqs == 4 and llm.max_model_len == 512
    assert llm.kv_plan.max_full_length_requests == 4
    assert LLM(dirs[0], device="cuda").max_num_seqs == 256  # the CUDA default
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.001 leaves no memory"):
        LLM(dirs[0], device="cuda", gpu_memory_utilization=0.001)
    with pytest.raises(ValueError, match="max_model_len=512 needs 32 KV blocks"):
        LLM(dirs[0], device="cuda", kv_cache_memory="64KiB")
    with pytest.raises(ValueError, match="does not fit in memory"):
        LLM(dirs[0], device="cuda", kv_cache_memory="100TiB", max_num_seqs=10**6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("method", [None, "draft_model", "eagle3"])
def test_prefix_hits_and_chunks_keep_the_cold_tokens(dirs, heads, dtype, method):
    """On the GPU: requests sharing first parts of every length, after a warm-up that publishes
    them, with chunks of 7 tokens (decodes and chunks in one eager forward without
    speculation): greedy and seeded tokens equal those of a cold engine without chunks."""
    spec = None if method is None else _spec(dirs, method, "probabilistic", heads)
    rng = np.random.default_rng(1)
    shared = rng.integers(3, VOCAB, size=70).tolist()
    prompts = [shared + [7, 8, 9]] + [shared[:cut] + rng.integers(3, VOCAB, size=9).tolist()
                                      for cut in (0, 16, 31, 48, 70, 70)] + [shared[:40]]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=i) for i in range(len(prompts))]
    cold = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8, max_model_len=256,
               speculative_config=spec, enable_prefix_caching=False,
               enable_chunked_prefill=False)
    expected = [cold.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    costs = None if method is None else cold.spec.costs
    del cold
    warm = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8, max_model_len=256,
               speculative_config=spec, max_num_batched_tokens=7)
    if costs is not None:
        warm.spec.costs = costs  # the same draft plan (test_preempted_and_pieced_...)
    warm.generate([prompts[0]], [params[0]])
    outputs = warm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert outputs[5].num_cached_tokens >= 48 and outputs[1].num_cached_tokens == 0


BINARY_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_token_trees_on_the_gpu(dirs, heads, dtype):
    """Token trees on CUDA (the tree attention kernel, the captured tree verify step up to its
    batch and eager beyond): greedy trees of a draft model (a static tree) and of EAGLE-3 and
    EAGLE heads (EAGLE-2's dynamic tree) emit the plain greedy tokens, with batches of 8 and 1;
    a seeded sampled request gives the same tokens alone and in the batch."""
    plain = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8)
    reference = _generate(plain, PROMPTS, temperature=0.0)
    trees = [("draft_model", {"speculative_token_tree": BINARY_TREE}),
             ("eagle3", {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 9}),
             ("eagle", {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6})]
    for method, tree in trees:
        config = dict(_spec(dirs, method, "probabilistic", heads), **tree)
        config["num_speculative_tokens"] = 3
        llm = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8,
                  speculative_config=config)
        assert _generate(llm, PROMPTS, temperature=0.0) == reference, method
        assert _generate(llm, PROMPTS[:1], temperature=0.0)[0] == reference[0], method
        assert llm.spec.stats.num_drafts > 0, method
        sampled = dict(temperature=0.9, seed=11)
        assert _generate(llm, PROMPTS[:1], **sampled)[0] == _generate(llm, PROMPTS,
                                                                       **sampled)[0], method
