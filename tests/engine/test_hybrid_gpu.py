"""A hybrid (Mamba2 + attention) model on the GPU engine (CUDA graphs, flat layout, Triton model
ops and the Triton SSM state update), on a CUDA device.

Strategy: a tiny random GraniteMoeHybrid target (head_dim 16, the attention kernel's minimum) and
drafts; every check compares two runs that must agree token for token: graphs against
``enforce_eager``; greedy speculation (n-gram, early exit through one and through every layer,
a hybrid and a Llama draft model) against plain greedy decoding, in bfloat16 and float32; a
request alone against the same request in a batch of 8 (another graph bucket), greedy and
seeded; the GPU engine against the CPU path in float32. At the runner level, a replayed step
(batch padded to its bucket, requests padded to the step's width) writes the logits and the
recurrent states of the eager step, bit for bit. Prompts longer than MAX_RECURRENT_TOKENS take
the chunked scan. Skipped without CUDA (CPU CI runs the same logic through the torch twins in
test_hybrid_flat.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.proposers.test_draft_model import save_llama
from verispec import LLM, SamplingParams
from verispec.engine import draft_planner
from verispec.models.loader import load_model
from verispec.runtime.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 512
LAYER_TYPES = ("mamba", "attention", "mamba", "mamba")


def save_hybrid_gpu(path, layer_types=LAYER_TYPES, seed: int = 0) -> str:
    """A tiny random GraniteMoeHybrid with head_dim 16 (8 heads of hidden 128)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        shared_intermediate_size=256, num_local_experts=0, layer_types=list(layer_types),
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=16, mamba_expand=2, position_embedding_type=None,
        embedding_multiplier=1.5, residual_multiplier=0.7, logits_scaling=0.5,
        attention_multiplier=0.1, initializer_range=0.1, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    GraniteMoeHybridForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return (save_hybrid_gpu(tmp_path_factory.mktemp("hybrid_target")),
            save_hybrid_gpu(tmp_path_factory.mktemp("hybrid_draft"), ("mamba", "attention"), 1),
            save_llama(tmp_path_factory.mktemp("llama_draft"), num_layers=2, vocab_size=VOCAB,
                       seed=2, hidden_size=64, initializer_range=0.1,
                       max_position_embeddings=512))


# the last two prompts are long: chunked scan, then the recurrent form for their last token
PROMPTS = [[5 + i, 17, 33 + 2 * i, 90, 11 + i, 17, 33 + 2 * i] for i in range(6)] + [
    [(7 * j + i) % VOCAB for j in range(40 + 9 * i)] for i in range(2)]


def _generate(llm: LLM, prompts, **params) -> list[list[int]]:
    params = SamplingParams(max_tokens=40, ignore_eos=True, **params)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _spec(dirs, name: str) -> dict:
    return {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "early_exit_1": {"method": "early_exit", "num_draft_layers": 1},
        "early_exit_all": {"method": "early_exit", "num_draft_layers": len(LAYER_TYPES)},
        "early_exit_probabilistic": {"method": "early_exit", "num_draft_layers": 2,
                                     "draft_sample_method": "probabilistic"},
        "hybrid_draft": {"method": "draft_model", "model": dirs[1]},
        "llama_draft": {"method": "draft_model", "model": dirs[2]},
    }[name] | {"num_speculative_tokens": 3}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graphs_match_eager_and_greedy_spec_matches_plain(dirs, dtype, monkeypatch):
    # every step drafts k: on these tiny models a captured draft costs more than it saves, so
    # the planner would otherwise stop drafting and leave the speculative paths untested
    monkeypatch.setattr(draft_planner, "best_num_drafts", lambda alpha, n, costs: n)
    plain = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8)
    assert plain.runner.graphs is not None and plain.runner.graphs.capture_time_s > 0
    reference = _generate(plain, PROMPTS, temperature=0.0)
    eager = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8, enforce_eager=True)
    assert eager.runner.graphs is None
    assert _generate(eager, PROMPTS, temperature=0.0) == reference
    for name in ("ngram", "early_exit_1", "early_exit_all", "hybrid_draft", "llama_draft"):
        spec = LLM(dirs[0], dtype=dtype, device="cuda", max_num_seqs=8,
                   speculative_config=_spec(dirs, name))
        assert _generate(spec, PROMPTS, temperature=0.0) == reference, name
        stats = spec.spec.stats
        assert stats.num_draft_tokens > 0
        if name.startswith("early_exit"):  # the draft replays its captured graph
            proposer = spec.spec.proposer
            assert proposer.runner.graphs.has(proposer.graph_name), name
        if name == "early_exit_all":  # every draft accepted: the rollback of full steps
            assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_captured_probabilistic_early_exit_equals_eager(dirs, temperature, monkeypatch):
    """Probabilistic early exit in the target's own cache: at every step of a generation the
    captured draft gives the tokens the eager draft gives on the same state (each step drafts
    eagerly first, then replays). The captured draft once wrote stale ids from its second replay
    on, after a verify graph had replayed: the sampler's scratch, made during the capture, came
    from the pool the graphs share."""
    monkeypatch.setattr(draft_planner, "best_num_drafts", lambda alpha, n, costs: n)
    llm = LLM(dirs[0], dtype="float32", device="cuda", max_num_seqs=8,
              speculative_config=_spec(dirs, "early_exit_probabilistic"))
    proposer = llm.spec.proposer
    assert proposer.runner.graphs.has(proposer.graph_name)
    propose, can_replay, steps = proposer.propose, proposer._can_replay, []

    def both(requests):
        proposer._can_replay = lambda *args: False
        try:
            eager = propose(requests).draft_token_ids.tolist()
        finally:
            proposer._can_replay = can_replay
        out = propose(requests)
        steps.append((eager, out.draft_token_ids.tolist()))
        return out

    proposer.propose = both
    _generate(llm, PROMPTS[:3], temperature=temperature, seed=3)
    assert len(steps) > 5 and sum(len(e) for e, _ in steps) > 20
    for i, (eager, captured) in enumerate(steps):
        assert captured == eager, i


def test_gpu_engine_matches_cpu_path_in_float32(dirs):
    cpu = LLM(dirs[0], dtype="float32", device="cpu", max_num_seqs=8)
    gpu = LLM(dirs[0], dtype="float32", device="cuda", max_num_seqs=8)
    assert _generate(gpu, PROMPTS, temperature=0.0) == _generate(cpu, PROMPTS, temperature=0.0)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.9, seed=7),
                                    dict(temperature=0.9, top_p=0.9, seed=3)])
def test_request_alone_equals_request_in_a_batch(dirs, params):
    """Batch 1 (bucket 1) and batch 8 (bucket 8), with speculation: same tokens; and the same
    request twice: same tokens."""
    llm = LLM(dirs[0], device="cuda", max_num_seqs=8,
              speculative_config=_spec(dirs, "early_exit_probabilistic"))
    alone = _generate(llm, PROMPTS[:1], **params)[0]
    assert _generate(llm, PROMPTS[:1], **params)[0] == alone
    assert _generate(llm, PROMPTS, **params)[0] == alone


def test_replayed_step_writes_what_the_eager_step_writes(dirs):
    """Same forwards through a runner replaying graphs and an eager one: the same logits and
    the same recurrent states, bit for bit (a batch of 3 padded to bucket 4; a verify step of
    3, 1 and 2 tokens padded to 4 per request; a rollback; decode)."""
    model = load_model(dirs[0], "bfloat16", "cuda").model
    graphs = ModelRunner(model, 4, 256, "cuda", max_step_tokens=4)
    graphs.capture([1, 4])
    eager = ModelRunner(model, 4, 256, "cuda", max_step_tokens=4, enforce_eager=True)
    slots = [2, 0, 1]
    steps = [PROMPTS[:2] + PROMPTS[-1:], [[4, 8, 15], [16], [23, 42]], [[1], [2], [3]]]
    for tokens in steps:
        out = [r.forward(slots, tokens, logits="all") for r in (graphs, eager)]
        assert torch.equal(out[0], out[1])
        if tokens is steps[1]:
            for r in (graphs, eager):
                r.kv_cache.truncate(2, r.kv_cache.length(2) - 2)  # one of three kept
    assert graphs.kv_cache.lengths_np.tolist() == eager.kv_cache.lengths_np.tolist()
    for a, b in zip(graphs.kv_cache.states, eager.kv_cache.states):
        for slot in slots:  # every ring entry a live length may read
            assert torch.equal(a.conv[slot], b.conv[slot])
            assert torch.equal(a.ssm[slot], b.ssm[slot])


def test_synthetic_mode_on_a_hybrid(dirs):
    llm = LLM(dirs[0], device="cuda", max_num_seqs=4, speculative_config={
        "method": "early_exit", "num_draft_layers": 1, "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5})
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=64, ignore_eos=True))
    assert all(len(o.token_ids) == 64 for o in outs)
    assert 2.2 < llm.spec.stats.mean_acceptance_length < 2.8
