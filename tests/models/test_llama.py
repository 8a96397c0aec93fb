"""Our Llama-family decoder against HF transformers, in float32.

Strategy: tiny random models of each supported architecture are saved with ``save_pretrained``
and loaded by our loader; their logits must equal HF's within 1e-4 (relative to the largest
logit) for a prefill, for token-by-token decode through our KV cache, for a padded batch of
prompts of different lengths, and for the multi-token append + truncate of a speculative step.
The bundled model is checked the same way on a few prompts.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.utils import (
    HF_CONFIGS,
    bundled_dir,
    bundled_hf_model,
    bundled_llm,
    requires_bundled,
    save_tiny_model,
)
from verispec.models import load_model
from verispec.models.config import ModelConfig
from verispec.models.layout import FlatBatch
from verispec.models.llama import LlamaForCausalLM
from verispec.models.parallel import TensorParallel
from verispec.models.rope import rope_tables
from verispec.ops.model_ops import TORCH_MODEL_OPS
from verispec.runtime.model_runner import ModelRunner

RTOL = 1e-4


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= RTOL * scale, f"max abs error {err:.3g} > {RTOL} x {scale:.3g}"


@pytest.fixture(scope="module", params=HF_CONFIGS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, request.param)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_model(str(path), "float32")


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


PROMPTS = [[5, 17, 33, 2, 90, 11, 64], [7, 3], [100, 101, 102, 103, 104, 105, 106, 107, 108, 9, 1]]


def test_prefill_matches_hf(tiny):
    hf, loaded = tiny
    runner = ModelRunner(loaded.model, 4, 64)
    for slot, ids in enumerate(PROMPTS):
        assert_close(runner.forward([slot], [ids], logits="all"), hf_logits(hf, ids))


def test_decode_through_kv_cache_matches_hf(tiny):
    hf, loaded = tiny
    runner = ModelRunner(loaded.model, 2, 64)
    ids = PROMPTS[0] + PROMPTS[2]
    rows = [runner.forward([1], [[t]])[0] for t in ids]  # one token per forward
    assert_close(torch.stack(rows), hf_logits(hf, ids))
    assert runner.kv_cache.length(1) == len(ids)


def test_padded_batch_matches_hf(tiny):
    """Prompts of different lengths in one forward (padding + mask), then a batched decode."""
    hf, loaded = tiny
    runner = ModelRunner(loaded.model, 4, 64)
    slots = [3, 0, 2]  # out of order: the cache rows are gathered
    out = runner.forward(slots, PROMPTS, logits="all")
    refs = [hf_logits(hf, ids) for ids in PROMPTS]
    assert_close(out, torch.cat(refs))
    last = runner.forward(slots, [[4], [5], [6]])  # decode at three different lengths
    for row, ids, t in zip(last, PROMPTS, [4, 5, 6]):
        assert_close(row, hf_logits(hf, ids + [t])[-1])


def test_multi_token_append_and_truncate(tiny):
    """A verify-shaped step: requests append 1, 3 and 4 tokens at once, then roll back to a
    committed length and continue; the result equals a fresh run of the committed tokens."""
    hf, loaded = tiny
    runner = ModelRunner(loaded.model, 3, 64)
    runner.forward([0, 1, 2], PROMPTS, logits="none")
    new = [[8], [9, 10, 11], [12, 13, 14, 15]]
    rows = runner.forward([0, 1, 2], new, logits="all")
    assert rows.shape[0] == 8
    starts = [0, 1, 4]
    for r, (ids, extra) in enumerate(zip(PROMPTS, new)):
        ref = hf_logits(hf, ids + extra)[-len(extra):]
        assert_close(rows[starts[r] : starts[r] + len(extra)], ref)
    # Request 2 keeps 2 of its 4 new tokens; then feeds a different continuation.
    runner.kv_cache.truncate(2, len(PROMPTS[2]) + 2)
    out = runner.forward([2], [[50, 51]], logits="all")
    assert_close(out, hf_logits(hf, PROMPTS[2] + [12, 13, 50, 51])[-2:])


def test_early_exit_runs_first_layers(tiny):
    hf, loaded = tiny
    runner = ModelRunner(loaded.model, 1, 64)
    ids = PROMPTS[0]
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1]
        ref = hf.lm_head(hf.model.norm(hidden))[0]
    assert_close(runner.forward([0], [ids], logits="all", num_layers=1), ref)


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.models.utils import tiny_hf_model

    model = tiny_hf_model("LlamaForCausalLM")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    runner = ModelRunner(load_model(str(tmp_path)).model, 1, 64)
    assert_close(runner.forward([0], [PROMPTS[0]], logits="all"), hf_logits(hf, PROMPTS[0]))


def test_bfloat16_close_to_float32(tiny):
    _, loaded = tiny
    bf16 = load_model(loaded.path, "bfloat16")
    assert bf16.model.embed_weight.dtype == torch.bfloat16
    a = ModelRunner(loaded.model, 1, 64).forward([0], [PROMPTS[0]], logits="all")
    b = ModelRunner(bf16.model, 1, 64).forward([0], [PROMPTS[0]], logits="all")
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()


@requires_bundled
@pytest.mark.slow
def test_bundled_model_matches_hf():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_dir())
    hf = bundled_hf_model()
    runner = ModelRunner(bundled_llm().loaded.model, 2, 128)  # its own cache, shared weights
    for text in ["The capital of France is", "def fibonacci(n):\n    "]:
        ids = tokenizer.encode(text)
        runner.kv_cache.free(0)
        assert_close(runner.forward([0], [ids], logits="all"), hf_logits(hf, ids))
        # then three decode steps through the cache
        ref = hf_logits(hf, ids + [28, 29, 30])[-3:]
        rows = [runner.forward([0], [[t]])[0] for t in (28, 29, 30)]
        assert_close(torch.stack(rows), ref)


@pytest.mark.parametrize("rows", [1, 2, 5, 37])
@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_linear_matches_f_linear(rows, splits, with_bias):
    """``linear`` with row blocks (the CPU float32 decode path) computes F.linear: a [B, S, in]
    input, weights whose row count the split divides, and a weight it does not divide (plain
    F.linear fallback)."""
    from verispec.models.llama import linear

    gen = torch.Generator().manual_seed(rows * 10 + splits)
    for out_features in (24, 25):
        weight = torch.randn(out_features, 16, generator=gen)
        bias = torch.randn(out_features, generator=gen) if with_bias else None
        x = torch.randn(1, rows, 16, generator=gen)
        ref = torch.nn.functional.linear(x, weight, bias)
        ours = linear(x, weight, bias, splits)
        assert ours.shape == ref.shape == (1, rows, out_features)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_runner_sets_cpu_matmuls(tiny):
    """The model runner turns the row-block matmuls on for CPU float32 (one block per thread),
    and for bfloat16 the widening from the row count where it pays (later with the compiled
    bfloat16 kernel, which stays memory-bound up to more rows)."""
    from verispec.ops import cpu_kernels
    from verispec.runtime import model_runner

    _, loaded = tiny
    ModelRunner(loaded.model, num_slots=1, max_model_len=64)
    assert loaded.model.matmul_splits == torch.get_num_threads()
    assert loaded.model.upcast_rows == 0
    assert all(layer.mlp.matmul_splits == torch.get_num_threads()
               for layer in loaded.model.layers)
    bf16 = load_model(loaded.path, "bfloat16")
    ModelRunner(bf16.model, num_slots=1, max_model_len=64)
    expected = (model_runner.CPU_UPCAST_ROWS_WITH_KERNEL if cpu_kernels.available()
                else model_runner.CPU_UPCAST_ROWS)
    assert bf16.model.upcast_rows == expected
    assert all(layer.attn.upcast_rows == expected for layer in bf16.model.layers)


@pytest.mark.parametrize("rows", [1, 5, 6, 9])
def test_bfloat16_linear_widened_from_upcast_rows(rows):
    """From ``upcast_rows`` rows on, a bfloat16 product is computed in float32 and rounded once:
    within one bfloat16 rounding of torch's bfloat16 matmul; below it, the compiled kernel where
    this machine has it (``cpu_kernels``), else torch's matmul itself."""
    from verispec.models.llama import linear
    from verispec.ops import cpu_kernels
    from verispec.ops.backend import get_backend

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(2, rows, 32, generator=gen).bfloat16()
    ours = linear(x, weight, bias, splits=2, upcast_rows=6, kernels=get_backend("cpu").cpu)
    assert ours.dtype == torch.bfloat16 and ours.shape == (2, rows, 48)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    if 2 * rows < 6:
        below = (cpu_kernels.bf16_linear if cpu_kernels.available()
                 else torch.nn.functional.linear)
        assert torch.equal(ours, below(x, weight, bias))
    # float32 accumulation, one rounding to bfloat16: within half an ulp of the exact value
    torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-6)


class _FusedTwin:
    """A stand-in for ``models.parallel.PeerReduceNorm`` in a one-rank group: the "sum over
    ranks" of a partial is the partial, so the deferred path must give the unfused bits."""

    def __init__(self) -> None:
        self.calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x, weight, eps, residual):
        self.calls += 1
        return TORCH_MODEL_OPS.rms_norm(x, weight, eps, residual)


@pytest.mark.parametrize("capture_layers", [(), (1,), (0, 2)])
def test_flat_forward_with_reductions_left_to_the_norms(capture_layers):
    """``LlamaForCausalLM.forward_flat`` with the all-reduces deferred into the following norms
    (``TensorParallel.defers_reduction``, the fused tensor-parallel kernel's wiring): the same
    hidden states and captured streams as the plain flat forward, one reduction per norm that
    follows a projection (2 per layer), the captured layers' streams reduced first."""
    config = ModelConfig(architecture="LlamaForCausalLM", head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=10000.0, vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config, torch.float32)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    twin = _FusedTwin()
    deferred = LlamaForCausalLM(config, torch.float32, tp=TensorParallel(fused=twin))
    deferred.load_state_dict(plain.state_dict())
    T, block_size, head_dim = 7, 4, config.hidden_size // config.num_attention_heads
    cos, sin = rope_tables(config, 16)
    positions = torch.arange(T)
    batch = FlatBatch(positions=positions, slot_mapping=positions + block_size,  # blocks 1, 2
                      slot_ids=torch.tensor([0]), context_lens=torch.tensor([T]),
                      query_start=torch.tensor([0, T]), max_queries=T, cos=cos, sin=sin,
                      ops=TORCH_MODEL_OPS, block_tables=torch.tensor([[1, 2], [0, 0]],
                                                                     dtype=torch.int32))
    ids = torch.randint(0, config.vocab_size, (T,))

    def run(model):
        caches = [torch.zeros(3, block_size, 2, head_dim) for _ in range(6)]
        return model.forward_flat(ids, batch, caches[:3], caches[3:],
                                  capture_layers=capture_layers)

    expected, got = run(plain), run(deferred)
    if capture_layers:
        assert torch.equal(expected[0], got[0])
        assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))
    else:
        assert torch.equal(expected, got)
    assert twin.calls == 2 * config.num_hidden_layers - len([i for i in capture_layers if i])
