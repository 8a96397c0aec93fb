"""Batch invariance on CPU, in float32 and bfloat16 (docs/design.md §12, issue 26 item 1).

Strategy: a request's rows must be computed the same way whatever else is in the batch and
however many tokens the step holds for it, so the checks compare bits, not closeness:
- the model runner's logits of one request, fed alone token by token, against the same tokens fed
  in batches with other requests of other lengths (padding, masks), several at a time (a verify
  step) and in a long prefill (where a matmul library would switch kernels): ``torch.equal``;
- through the engine: greedy and seeded requests give the same tokens alone as in a batch, in two
  runs; greedy speculative output (n-gram, draft model, early exit) is the plain greedy output.
``batch_invariant=False`` is the explicit opt-out: its rows may differ (not asserted), and it must
still decode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.utils import requires_bundled
from verispec import LLM, SamplingParams
from verispec.models import load_model
from verispec.runtime.model_runner import ModelRunner

VOCAB = 256
MAX_MODEL_LEN = 128
DTYPES = ["float32", "bfloat16"]


def save_model(path, num_layers: int, seed: int) -> str:
    """A random Llama with the bundled SmolLM2-135M's widths (hidden 576, FFN 1536, 9 / 3
    heads: matrices large enough that torch's CPU matmuls pick their kernels by the number of
    rows) but two layers and a small vocabulary, so that it runs in milliseconds a step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-5, initializer_range=0.04, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("target"), num_layers=2, seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("draft"), num_layers=1, seed=1)


def token_lists(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", DTYPES)
def test_runner_rows_do_not_depend_on_the_batch_or_the_step(dtype, target_dir):
    """Request A's logits at every position, bit for bit: fed alone one token per step, against
    a prefill batched with a shorter and a longer prompt (padding, a mask), a verify-shaped step
    of four tokens beside requests feeding two and one, then decode steps beside others; and a
    40-token prompt prefilled in one step (where a bfloat16 matmul would be widened to float32)
    against the same tokens one per step."""
    model = load_model(target_dir, dtype).model
    prompt_a, prompt_b, prompt_c, long_prompt = token_lists(0, [12, 7, 33, 40])
    follow_a, follow_b, follow_c = token_lists(1, [6, 8, 8])

    def one_per_step(tokens: list[int]) -> torch.Tensor:
        runner = ModelRunner(model, num_slots=4, max_model_len=MAX_MODEL_LEN)
        return torch.cat([runner.forward([1], [[t]]) for t in tokens])

    ref = one_per_step(prompt_a + follow_a)  # [18, V]: the logits after each token

    runner = ModelRunner(model, num_slots=4, max_model_len=MAX_MODEL_LEN)
    prefill = runner.forward([3, 1, 0], [prompt_b, prompt_a, prompt_c], logits="all")
    verify = runner.forward([0, 1, 3], [follow_c[:2], follow_a[:4], follow_b[:1]],
                            logits="all")
    decode = [runner.forward([3, 1], [[follow_b[1]], [follow_a[4]]])[1:2],
              runner.forward([1, 0], [[follow_a[5]], [follow_c[2]]])[0:1]]
    batched = torch.cat([prefill[7:19], verify[2:6], *decode])
    assert torch.equal(batched, ref)

    long_at_once = ModelRunner(model, num_slots=2, max_model_len=MAX_MODEL_LEN).forward(
        [1], [long_prompt], logits="all")
    assert torch.equal(long_at_once, one_per_step(long_prompt))


def mixed_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 == 0
            else SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24,
                                ignore_eos=True)
            for i in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_requests_give_the_same_tokens_alone_or_batched_every_run(dtype, target_dir):
    """Six prompts of 3-40 tokens, greedy and seeded, through four slots (requests join as
    others finish) give each prompt's tokens alone; and the same tokens in a second run."""
    llm = LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    prompts = token_lists(2, [3, 40, 11, 25, 6, 17])
    params = mixed_params(len(prompts))
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    assert [o.token_ids for o in llm.generate(prompts, params)] == batched


def spec_config(method: str, draft_dir: str) -> dict:
    k = {"num_speculative_tokens": 3}
    return {"ngram": dict(k, method="ngram", prompt_lookup_min=1, prompt_lookup_max=3),
            "draft_model": dict(k, method="draft_model", model=draft_dir),
            "early_exit": dict(k, method="early_exit", num_draft_layers=1)}[method]


SPEC_PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4 + [12], *token_lists(3, [9, 30])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    """dtype -> the plain engine's greedy tokens for SPEC_PROMPTS (computed once per dtype)."""
    results = {}

    def get(dtype: str) -> list[list[int]]:
        if dtype not in results:
            llm = LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
            results[dtype] = [o.token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)]
        return results[dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["ngram", "draft_model", "early_exit"])
def test_greedy_speculative_output_is_the_plain_greedy_output(dtype, method, target_dir,
                                                              draft_dir, plain_greedy):
    """Token for token, for every proposer, in both dtypes; repetitive prompts so that drafts
    are proposed and some accepted (verify steps of several tokens commit them)."""
    llm = LLM(target_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=3,
              speculative_config=spec_config(method, draft_dir))
    assert [o.token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)] == plain_greedy(dtype)
    assert llm.get_metrics()["spec_decoding"]["num_drafts"] > 0


@requires_bundled
@pytest.mark.slow
def test_bundled_model_bfloat16_ngram_is_plain_greedy_alone_or_batched():
    """The issue's reproduction on the bundled SmolLM2-135M in bfloat16 (before the fix, most
    of these chat prompts changed tokens alone vs batched, and n-gram vs plain): six prompts,
    48 greedy tokens each, alone, batched, and batched with n-gram speculation."""
    prompts = [[{"role": "user", "content": text}] for text in (
        "Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
        "What are the benefits of regular exercise?", "Describe the water cycle.",
        "Give me three tips for writing clean code.", "Why is the sky blue?")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=8)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert [llm.generate(p, params)[0].token_ids for p in prompts] == batched
    spec = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=8, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert [o.token_ids for o in spec.generate(prompts, params)] == batched


def test_opt_out_still_decodes(target_dir):
    """``batch_invariant=False`` (torch's own matmul and attention choices on CPU) runs; greedy
    tokens need not match the invariant path's, so only their count is checked."""
    llm = LLM(target_dir, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
              batch_invariant=False)
    assert all(m.batch_invariant is False for m in llm.runner.model.modules()
               if hasattr(m, "batch_invariant"))
    outs = llm.generate(token_lists(4, [5, 30]), SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]
