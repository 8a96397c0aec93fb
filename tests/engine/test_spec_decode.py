"""Speculative decoding through the whole engine, on tiny random models.

Strategy: properties that must hold for any weights.
- Greedy: speculative output == non-speculative output, token for token, for every proposer.
- Sampling exactness: 20 000 seeded requests per configuration; the distribution of each of the
  first three generated tokens with speculation (n-gram, draft model and early exit; greedy and
  probabilistic drafts) is compared with the same engine without speculation by a two-sample
  chi-square test (p >= 1e-6). Different seed ranges, so the two samples are independent.
- Synthetic mode: configured mean acceptance length 2.5 with k = 4 is what the engine measures.
- A draft model identical to the target accepts (nearly) everything.
- Stop conditions inside an accepted run, max_tokens exact, and after every step the target cache
  holds the committed tokens but the last, the draft cache the committed tokens it has consumed.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from tests.models.utils import copy_bundled_tokenizer, requires_bundled
from tests.proposers.test_draft_model import save_llama
from verispec import LLM, SamplingParams
from verispec.engine.draft_planner import best_num_drafts, verify_costs

VOCAB = 16
MAX_MODEL_LEN = 64
P_VALUE_THRESHOLD = 1e-6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("target"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("draft"), num_layers=1, seed=1,
                      vocab_size=VOCAB)


def spec_configs(draft_dir):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3},
        "draft_model_greedy": {"method": "draft_model", "model": draft_dir,
                               "num_speculative_tokens": 3},
        "draft_model_probabilistic": {"method": "draft_model", "model": draft_dir,
                                      "num_speculative_tokens": 3,
                                      "draft_sample_method": "probabilistic"},
        "early_exit_greedy": {"method": "early_exit", "num_draft_layers": 1,
                              "num_speculative_tokens": 3},
        "early_exit_probabilistic": {"method": "early_exit", "num_draft_layers": 2,
                                     "num_speculative_tokens": 3,
                                     "draft_sample_method": "probabilistic"},
    }


PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive, so n-gram finds drafts


def engine(target_dir, spec=None, max_num_seqs=8, max_model_len=MAX_MODEL_LEN):
    return LLM(target_dir, dtype="float32", max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, speculative_config=spec)


@pytest.mark.parametrize(
    "name", ["ngram", "draft_model_greedy", "draft_model_probabilistic", "early_exit_greedy"]
)
def test_greedy_speculative_equals_plain(name, target_dir, draft_dir):
    rng = np.random.default_rng(0)
    prompts = [PROMPT] + [rng.integers(3, VOCAB, size=rng.integers(2, 20)).tolist()
                          for _ in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = engine(target_dir).generate(prompts, params)
    llm = engine(target_dir, spec_configs(draft_dir)[name], max_num_seqs=3)
    spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
    assert llm.get_metrics()["spec_decoding"]["num_drafts"] > 0


def _first_tokens(llm, num_requests, seed_base, params_kwargs):
    params = [SamplingParams(seed=seed_base + i, max_tokens=3, ignore_eos=True, **params_kwargs)
              for i in range(num_requests)]
    outs = llm.generate([PROMPT] * num_requests, params)
    tokens = np.array([o.token_ids for o in outs])  # [N, 3]
    return np.stack([np.bincount(tokens[:, j], minlength=VOCAB) for j in range(3)])


def _two_sample_p(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) > 0
    table = np.stack([a[keep], b[keep]])
    # merge sparse columns (expected counts under 5) into one
    sparse = table.sum(0) < 10
    if sparse.any():
        table = np.concatenate([table[:, ~sparse], table[:, sparse].sum(1, keepdims=True)], 1)
    if table.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(table)[1])


NUM_REQUESTS = 20_000
SAMPLING = {"temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def plain_counts(target_dir):
    return _first_tokens(engine(target_dir, max_num_seqs=2048), NUM_REQUESTS, 0, SAMPLING)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["ngram", "draft_model_greedy", "draft_model_probabilistic", "early_exit_greedy",
     "early_exit_probabilistic"],
)
def test_sampling_exactness_through_engine(name, target_dir, draft_dir, plain_counts):
    llm = engine(target_dir, spec_configs(draft_dir)[name], max_num_seqs=2048)
    counts = _first_tokens(llm, NUM_REQUESTS, 10_000_000, SAMPLING)
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_drafts"] > 1000  # speculation really happened
    for position in range(3):
        p = _two_sample_p(plain_counts[position], counts[position])
        assert p >= P_VALUE_THRESHOLD, f"{name}: generated token {position} p-value {p:.3g}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_synthetic_mean_acceptance_length(temperature, target_dir):
    spec = {"method": "early_exit", "num_draft_layers": 1, "num_speculative_tokens": 4,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    llm = engine(target_dir, spec, max_num_seqs=64, max_model_len=256)
    params = [SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True, seed=i)
              for i in range(64)]
    llm.generate([PROMPT] * 64, params)
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_drafts"] >= 2000
    assert metrics["mean_acceptance_length"] == pytest.approx(2.5, abs=0.05)


def test_identical_draft_model_accepts_everything(target_dir, monkeypatch):
    """Every draft of a copy of the target is accepted (the planner, which would not draft
    with a model that costs a whole decode step per draft, always drafts k here)."""
    from verispec.engine import draft_planner

    monkeypatch.setattr(draft_planner, "best_num_drafts", lambda alpha, n, costs: n)
    k = 3
    spec = {"method": "draft_model", "model": target_dir, "num_speculative_tokens": k}
    llm = engine(target_dir, spec, max_model_len=256)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=10).tolist() for _ in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=200,
                                                ignore_eos=True))
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["draft_acceptance_rate"] >= 0.98
    assert metrics["mean_acceptance_length"] >= 0.98 * (k + 1)
    assert all(o.spec_stats.num_drafts > 0 for o in outs)


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    """A tiny model with the bundled tokenizer, for stop strings."""
    path = tmp_path_factory.mktemp("text")
    save_llama(path, vocab_size=49152, num_layers=2, seed=4)
    copy_bundled_tokenizer(str(path))
    return str(path)


@requires_bundled
def test_stops_inside_an_accepted_run(text_model_dir):
    spec = {"method": "draft_model", "model": text_model_dir, "num_speculative_tokens": 5}
    prompt = [100, 200, 300, 400]
    plain = engine(text_model_dir, max_model_len=128).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    llm = engine(text_model_dir, spec, max_model_len=128)
    ref = plain.token_ids
    # a stop token in the middle of what the identical draft gets accepted in one step
    cut = next(i for i in range(3, 20) if ref[i] not in ref[:i])
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                              stop_token_ids=[ref[cut]]))[0]
    assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop"
    # max_tokens is exact even when k + 1 tokens could be accepted at once
    for max_tokens in (1, 2, 7, 9):
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                  ignore_eos=True))[0]
        assert out.token_ids == ref[:max_tokens] and out.finish_reason == "length"
    # a stop string inside an accepted run: the text ends before it, no token after its end
    text = llm.tokenizer.decode(ref)
    stop = text[len(text) // 3: len(text) // 3 + 3]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop],
                                              ignore_eos=True))[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert text.startswith(out.text)
    assert len(out.token_ids) < len(ref)
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])


@pytest.mark.parametrize("name", ["draft_model_greedy", "draft_model_probabilistic", "ngram"])
def test_cache_lengths_follow_committed_tokens_after_every_step(name, target_dir, draft_dir):
    llm = engine(target_dir, spec_configs(draft_dir)[name], max_num_seqs=4)
    proposer = llm.spec.proposer
    rng = np.random.default_rng(2)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=int(rng.integers(5, 40)),
                             ignore_eos=True)
              for i, t in enumerate([0.0, 1.0, 0.7, 0.0, 1.0, 0.0])]
    requests = []
    for i, p in enumerate(params):
        request = llm._make_request(PROMPT[: 2 + i], p)
        llm.scheduler.add(request)
        requests.append(request)
    target_cache = llm.runner.kv_cache
    draft_cache = getattr(getattr(proposer, "runner", None), "kv_cache", None)
    steps = 0
    while llm.scheduler.has_unfinished:
        drafts_before = {r.request_id: r.spec_stats.num_drafts if r.spec_stats else 0
                         for r in requests}
        llm.step()
        steps += 1
        for r in llm.scheduler.running:
            assert target_cache.length(r.slot) == r.num_tokens - 1
            if draft_cache is not None:
                # never more than the committed tokens; after a step in which the request
                # drafted, every committed token but the last one or two (d_k and the bonus
                # after an all-accepted step; the proposer catches up lazily)
                assert draft_cache.length(r.slot) <= r.num_tokens - 1
                if r.spec_stats.num_drafts > drafts_before[r.request_id]:
                    assert draft_cache.length(r.slot) >= r.num_tokens - 2
    assert steps > 5
    for r, p in zip(requests, params):
        assert r.finished and r.num_output_tokens == p.max_tokens
    assert all(n == 0 for n in target_cache.lengths_np)
    if draft_cache is not None:
        assert all(n == 0 for n in draft_cache.lengths_np)


def test_mixed_batch_with_and_without_drafts(target_dir, draft_dir):
    """Greedy and sampled requests, some with drafts and some without, one batch; the greedy
    ones equal the plain engine, the seeded ones are reproducible."""
    prompts = [PROMPT, [9, 10], PROMPT[:5], [11, 12, 13]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, seed=6, max_tokens=20, ignore_eos=True)]
    spec = spec_configs(draft_dir)["ngram"]
    first = engine(target_dir, spec).generate(prompts, params)
    again = engine(target_dir, spec, max_num_seqs=2).generate(prompts, params)
    plain = engine(target_dir).generate(prompts, params)
    for i in range(4):
        assert first[i].token_ids == again[i].token_ids
        if params[i].temperature == 0.0:
            assert first[i].token_ids == plain[i].token_ids


def linear_costs(beta, max_n):
    return [1.0 + beta * n for n in range(max_n + 1)]


def test_best_num_drafts_switches_off_when_it_does_not_pay():
    assert best_num_drafts(0.9, 5, linear_costs(0.03, 5)) == 5
    assert best_num_drafts(0.05, 5, linear_costs(0.11, 5)) == 0
    assert best_num_drafts(0.0, 5, linear_costs(0.0, 5)) == 0
    assert best_num_drafts(1.0, 4, linear_costs(0.11, 4)) == 4
    assert 0 < best_num_drafts(0.5, 8, linear_costs(0.11, 8)) < 8
    # A cost that is flat after the first extra token: draft all or nothing.
    flat = [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert best_num_drafts(0.5, 5, flat) == 0  # E(5) = 1.97 < 2
    assert best_num_drafts(0.6, 5, flat) == 5  # E(5) = 2.38


def test_verify_costs_tables():
    import torch

    gpu = verify_costs(torch.device("cuda"), torch.bfloat16, 4)
    assert gpu == pytest.approx((1.0, 1.01, 1.02, 1.03, 1.04))
    for dtype in (torch.float32, torch.bfloat16):
        costs = verify_costs(torch.device("cpu"), dtype, 12)
        assert len(costs) == 13 and costs[0] == 1.0
        assert all(b >= a for a, b in zip(costs, costs[1:]))  # never cheaper with more tokens


def test_verify_costs_follow_the_cpu_kernels(monkeypatch):
    """Verification is cheap where the compiled kernels run the matmuls (each weight row read
    once for several input rows), dear with torch's bfloat16 matmul."""
    from types import SimpleNamespace

    import torch

    from verispec.engine import draft_planner

    def backend(*bf16_isas):  # a CPU backend with compiled kernels of these ISAs, or none
        cpu = SimpleNamespace(bf16_isas=lambda: bf16_isas) if bf16_isas else None
        monkeypatch.setattr(draft_planner, "get_backend", lambda device: SimpleNamespace(cpu=cpu))

    backend("avx2", "avx512_bf16")
    fast = verify_costs(torch.device("cpu"), torch.bfloat16, 6)
    assert fast == draft_planner.CPU_VERIFY_COSTS_WITH_KERNELS
    assert verify_costs(torch.device("cpu"), torch.float32, 6) == fast
    backend("avx2", "avx512_bf16", "amx")
    amx = verify_costs(torch.device("cpu"), torch.bfloat16, 6)
    assert amx == draft_planner.CPU_VERIFY_COSTS_AMX
    assert all(a <= f for a, f in zip(amx, fast))
    assert verify_costs(torch.device("cpu"), torch.float32, 6) == fast  # AMX is bfloat16 only
    backend()
    slow = verify_costs(torch.device("cpu"), torch.bfloat16, 6)
    assert slow == draft_planner.CPU_VERIFY_COSTS[torch.bfloat16]
    assert all(f < s for f, s in zip(fast[1:], slow[1:]))
    assert best_num_drafts(0.5, 6, fast) > best_num_drafts(0.5, 6, slow)



def test_planner_costs_add_the_draft_models_forwards(target_dir, draft_dir):
    """A proposer with a model of its own adds n times its forward (the bytes of its matmul
    weights over the target's) to the cost of n drafts; a lookup adds nothing; a model drafting
    for itself costs a whole decode step per draft."""
    from verispec.proposers.base import matmul_weight_bytes

    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = LLM(target_dir, speculative_config=spec)
    proposer, runner = llm.spec.proposer, llm.runner
    ratio = matmul_weight_bytes(proposer.runner.model) / matmul_weight_bytes(runner.model)
    assert 0 < ratio < 1 and proposer.draft_cost == pytest.approx(ratio)
    base = verify_costs(runner.device, runner.dtype, 3)
    assert llm.spec.costs == pytest.approx([c + n * ratio for n, c in enumerate(base)])
    same = LLM(target_dir, speculative_config=dict(spec, model=target_dir)).spec
    assert same.proposer.draft_cost == pytest.approx(1.0)
    ngram = LLM(target_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 2})
    assert ngram.spec.proposer.draft_cost == 0.0 and ngram.spec.costs == base


def test_step_without_drafts_is_a_plain_decode_step(target_dir):
    """When no request drafts, the speculative engine takes the plain decode path; its sampled
    tokens are the bonus tokens of the rejection sampler, so seeded sampled requests equal the
    plain engine's token for token (every request switched off from the first step)."""
    prompts = [[9, 10], PROMPT, [1, 2, 3, 4, 5, 6]]
    params = [SamplingParams(temperature=t, seed=s, top_k=k, max_tokens=16, ignore_eos=True)
              for t, s, k in ((1.0, 3, 0), (0.7, 4, 6), (0.0, 5, 0))]
    llm = engine(target_dir, {"method": "ngram", "num_speculative_tokens": 3,
                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})

    def plan_nothing(batch):
        for r in batch:
            r.max_num_draft_tokens = 0

    llm.spec._plan = plan_nothing
    spec = llm.generate(prompts, params)
    plain = engine(target_dir).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.spec.num_steps == 15 and llm.spec.stats.num_drafts == 0


def test_failed_probes_back_off():
    """A request whose drafts always fail is switched off and probed at doubling intervals
    (16, 32, 64, ... capped at MAX_REPROBE_STEPS); a passing probe resets the interval."""
    from types import SimpleNamespace

    from verispec.engine import draft_planner as dp
    from verispec.engine import spec_decode as sd

    dec = sd.SpeculativeDecoder.__new__(sd.SpeculativeDecoder)
    dec.k, dec.max_model_len, dec.adaptive = 4, 10_000, True
    dec.costs = linear_costs(0.35, 4)
    dec.planner = planner = dp.DraftPlanner(1)
    assert planner._accepted[0] == dp.ALPHA_PRIOR * dp.PRIOR_TRIALS
    assert planner._tried[0] == dp.PRIOR_TRIALS and planner._steps_off[0] == 0
    assert planner._probe_interval[0] == dp.REPROBE_STEPS and not planner._probing[0]
    params = SimpleNamespace(max_tokens=100_000)
    req = SimpleNamespace(slot=0, num_tokens=10, num_output_tokens=0, params=params,
                          max_num_draft_tokens=0)
    drafted_at = []
    for step in range(2000):
        dec._plan([req])
        if req.max_num_draft_tokens:
            drafted_at.append(step)
            planner.observe(0, req.max_num_draft_tokens, 0)  # every draft fails
    gaps = np.diff(drafted_at).tolist()
    assert drafted_at[0] == 0  # the optimistic prior drafts at once
    probe_gaps = [g for g in gaps if g > 1]
    assert probe_gaps[:5] == [16, 32, 64, 128, 256]  # each failed probe doubles the interval
    assert set(probe_gaps[5:]) == {dp.MAX_REPROBE_STEPS}
    assert len(drafted_at) < 20  # a fixed interval of 16 would probe ~120 times
    planner._probing[0] = True  # a probe that passes resets the interval
    planner.observe(0, 1, 1)
    assert planner._probe_interval[0] == dp.REPROBE_STEPS


def test_alpha_counts_drafts_tried_not_drafted():
    """Drafts after the first rejected one were never tried: k = 3 drafts that stop at the
    second count 1 accepted of 2 tried (alpha 0.5), all accepted count k of k."""
    from verispec.engine.draft_planner import DraftPlanner

    planner = DraftPlanner(2)
    planner._accepted, planner._tried = np.zeros(2), np.zeros(2)
    for _ in range(50):
        planner.observe(0, 3, 1)
        planner.observe(1, 3, 3)
    assert planner.alpha(0) == pytest.approx(0.5) and planner.alpha(1) == pytest.approx(1.0)
