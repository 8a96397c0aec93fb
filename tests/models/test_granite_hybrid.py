"""The Mamba2 + attention hybrid (GraniteMoeHybrid, dense) against transformers' own model.

Strategy: tiny random HF models written with ``save_pretrained`` and loaded through the registry
and the safetensors loader. Logits of a long prompt (chunked scan, several chunks), of a short
one (recurrent form) and of decode steps after each must be close to HF's full-sequence forward;
greedy tokens equal HF ``generate``. Then the properties speculative decoding relies on, exactly:
a verify step of k + 1 tokens gives the bits of k + 1 decode steps, a request's bits do not depend
on its batch, and truncating a slot to any length its state ring holds continues exactly as if
the rolled-back tokens had never been fed (a length it no longer holds is a ValueError).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from verispec.models.config import HybridModelConfig
from verispec.models.loader import load_model
from verispec.models.mamba2 import MAX_RECURRENT_TOKENS
from verispec.runtime.model_runner import ModelRunner
from verispec.runtime.state_cache import HybridCache

VOCAB = 16
LAYER_TYPES = ("mamba", "attention", "mamba", "mamba")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: threads only add waiting (on this shared 2-core machine two threads made
    these tests ten times slower); the setting is restored afterwards."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def tiny_hybrid_hf(*, vocab_size: int = VOCAB, layer_types=LAYER_TYPES, seed: int = 0,
                   rope: bool = False, biases: bool = False, chunk_size: int = 8,
                   initializer_range: float = 0.2):
    """A tiny random HF GraniteMoeHybridForCausalLM (dense, fp32, eval). initializer_range 0.2
    spreads the logits (argmax near-ties are rare); HF's fixed A_log, dt_bias, D and norm weights
    are perturbed so every parameter is really tested."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        shared_intermediate_size=48, num_local_experts=0, layer_types=list(layer_types),
        mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=chunk_size, mamba_expand=2, mamba_proj_bias=biases,
        mamba_conv_bias=not biases, attention_bias=biases,
        position_embedding_type="rope" if rope else None,
        embedding_multiplier=1.5, residual_multiplier=0.7, logits_scaling=0.5,
        attention_multiplier=0.3, initializer_range=initializer_range, rms_norm_eps=1e-5,
        tie_word_embeddings=not biases, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            mixer_param = "mamba" in name and ("norm" in name
                                               or name.endswith(("bias", "A_log", ".D")))
            if mixer_param or "layernorm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def save_hybrid(path, **kwargs) -> str:
    tiny_hybrid_hf(**kwargs).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    model = tiny_hybrid_hf()
    model.save_pretrained(path)
    return model, str(path)


def _runner(model_dir, num_slots=4, max_step_tokens=5):
    loaded = load_model(model_dir)
    return ModelRunner(loaded.model, num_slots, 256, max_step_tokens=max_step_tokens)


@pytest.mark.parametrize("variant", [{}, {"rope": True, "biases": True}],
                         ids=["nope", "rope_biases"])
def test_logits_match_transformers(variant, tmp_path):
    hf = tiny_hybrid_hf(**variant)
    hf.save_pretrained(tmp_path)
    runner = _runner(str(tmp_path))
    assert isinstance(runner.kv_cache, HybridCache)
    ids = torch.randint(3, VOCAB, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.3  # logits spread: a real comparison
    # slot 0: a 45-token prompt (chunked scan over 6 chunks of 8), slot 1: a 20-token prompt
    # (recurrent form); then both decode one token a step in one batch.
    long_prompt, short_prompt = 45, 20
    assert short_prompt <= MAX_RECURRENT_TOKENS < long_prompt
    got_long = [runner.forward([0], [ids[:long_prompt]], logits="all")]
    got_short = [runner.forward([1], [ids[:short_prompt]], logits="all")]
    for t in range(short_prompt, 60):
        if t < long_prompt:
            got_short.append(runner.forward([1], [[ids[t]]]))
        else:
            rows = runner.forward([0, 1], [[ids[t]], [ids[t]]])
            got_long.append(rows[:1])
            got_short.append(rows[1:])
    torch.testing.assert_close(torch.cat(got_long), ref[:60], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got_short), ref[:60], atol=2e-5, rtol=1e-4)


def test_greedy_tokens_equal_transformers_generate(hf_and_dir):
    from verispec import LLM, SamplingParams

    hf, model_dir = hf_and_dir
    hf.generation_config.eos_token_id = None  # generate all 24 tokens, as ignore_eos
    llm = LLM(model_dir, dtype="float32", max_model_len=128, max_num_seqs=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 40, 12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_verify_step_bits_equal_decode_steps_and_batch_invariant(hf_and_dir):
    """A verify forward of k + 1 tokens, batched with another request of a different length, gives
    the bits of k + 1 one-token steps of the request alone (docs/design.md §12)."""
    _, model_dir = hf_and_dir
    runner = _runner(model_dir)
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    alone = runner.forward([0], [ids[:40]], logits="all")
    batched = runner.forward([1, 2], [ids[:40], ids[7:30]], logits="all")
    assert torch.equal(alone, batched[:40])
    one = torch.cat([runner.forward([0], [[t]]) for t in ids[40:52]])
    verify = []
    for s in range(40, 52, 4):
        rows = runner.forward([2, 1], [ids[s - 10:s - 7], ids[s:s + 4]], logits="all")
        verify.append(rows[3:])
    assert torch.equal(torch.cat(verify), one)


def test_verify_bits_at_granite_4_head_shape(tmp_path):
    """The same exactness at granite-4.0-h's SSM shape (48 heads x 32 x state 128), where the
    per-token matrix products run through MKL rather than torch's small-size loop."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=1, num_attention_heads=12,
        num_key_value_heads=4, shared_intermediate_size=32, num_local_experts=0,
        layer_types=["mamba"], mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128,
        mamba_n_groups=1, initializer_range=0.05, tie_word_embeddings=True,
    )).save_pretrained(tmp_path)
    runner = _runner(str(tmp_path), num_slots=3)
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    runner.forward([0], [ids[:40]])
    runner.forward([1], [ids[:40]])
    runner.forward([2], [ids[5:30]])
    one = torch.cat([runner.forward([0], [[t]]) for t in ids[40:48]])
    verify = [runner.forward([1], [ids[40:44]], logits="all"),
              runner.forward([2, 1], [ids[30:33], ids[44:48]], logits="all")[3:]]
    assert torch.equal(torch.cat(verify), one)


def test_rollback_to_any_length_the_ring_holds(hf_and_dir):
    _, model_dir = hf_and_dir
    k = 3
    runner = _runner(model_dir, num_slots=2, max_step_tokens=k + 1)
    cache = runner.kv_cache
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt = 40  # one chunked-scan feed: only the states after its last two tokens are kept
    runner.forward([1], [ids[:prompt]])  # slot 1: straight through, no rollback
    reference = runner.forward([1], [ids[prompt:50]], logits="all")
    runner.forward([0], [ids[:prompt]])
    with pytest.raises(ValueError, match="recurrent state is kept for lengths 39..40"):
        cache.truncate(0, prompt - 2)
    for accepted in range(k + 2):  # keep 0 .. k + 1 of the k + 1 verified positions
        cache.free(0)
        runner.forward([0], [ids[:prompt]])
        runner.forward([0], [ids[prompt:prompt + k + 1]], logits="all")  # a verify step
        cache.truncate(0, prompt + accepted)
        rows = runner.forward([0], [ids[prompt + accepted:50]], logits="all")
        assert torch.equal(rows, reference[accepted:])
    # an early-exit draft (first layer only) then back to the length it started from
    cache.free(0)
    runner.forward([0], [ids[:prompt]])
    runner.forward([0], [ids[prompt:prompt + k]], num_layers=1)
    cache.truncate(0, prompt)
    assert torch.equal(runner.forward([0], [ids[prompt:50]], logits="all"), reference)
    # that 10-token feed kept its last ring_size lengths only
    with pytest.raises(ValueError, match="recurrent state is kept for lengths"):
        cache.truncate(0, 50 - cache.ring_size)
    cache.truncate(0, 50 - cache.ring_size + 1)
    assert torch.equal(runner.forward([0], [ids[50 - cache.ring_size + 1:50]], logits="all"),
                       reference[10 - cache.ring_size + 1:])


def test_state_memory_is_logged_at_start(hf_and_dir, capsys):
    _, model_dir = hf_and_dir
    capsys.readouterr()
    runner = _runner(model_dir, num_slots=3, max_step_tokens=4)
    err = capsys.readouterr().err
    cache = runner.kv_cache
    config = runner.config
    per_position = 4 * (config.mamba_conv_dim * (config.mamba_d_conv - 1)
                        + config.mamba_n_heads * config.mamba_d_head * config.mamba_d_state)
    expected = 3 * 5 * len(config.mamba_layers) * per_position
    assert cache.state_nbytes == expected
    assert f"3 slots x 5 positions (max_step_tokens + 1) = {expected} bytes" in err


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_local_experts": 4}, "num_local_experts=4"),
     ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "layer_types holds"),
     ({"layer_types": ["mamba"]}, "layer_types has 1 entries"),
     ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
     ({"mamba_d_head": 5}, "mamba_d_head"),
     ({"time_step_limit": [1.0, 0.5]}, "time_step_limit")],
)
def test_bad_config_is_one_clear_error(hf_and_dir, tmp_path, change, message):
    _, model_dir = hf_and_dir
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.update(change)
    with pytest.raises(ValueError, match=message):
        HybridModelConfig.from_hf_dict(config, "GraniteMoeHybridForCausalLM")
