"""``LLM.generate`` on a tiny random model that has the bundled model's tokenizer.

Strategy: a tiny model (2 layers, hidden 64, vocab 49152) is fast enough to run the engine
through many batches; the checks are properties that hold for any weights: a request's tokens do
not depend on its batch (greedy and seeded sampling, continuous batching with fewer slots than
requests), stop conditions and max_tokens are exact, bad input gives one ValueError naming the
cause, and a bad request in a batch does not stop the others.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from verispec import LLM, SamplingParams

pytestmark = requires_bundled

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152)
    copy_bundled_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=3)


@pytest.fixture(scope="module")
def small_vocab_llm(tmp_path_factory):
    """No tokenizer, vocab 256: token-id prompts only, and cheap sampling."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny_model(path, "Qwen3ForCausalLM", vocab_size=256)
    return LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=3)


def random_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def mixed_params(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=5 + 3 * i) if i % 2 == 0
        else SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1000 + i,
                            max_tokens=5 + 3 * i)
        for i in range(n)
    ]


def test_batch_invariance_with_continuous_batching(small_vocab_llm):
    """8 prompts of different lengths through 3 slots (waiting requests join as others finish)
    give the same tokens as each prompt alone; greedy and seeded sampling.

    Regression: the step released finished requests from the very list it was walking, so the
    request after a finished one skipped its commit and fed a stale token the next step."""
    llm = small_vocab_llm
    prompts, params = random_prompts(8, 256), mixed_params(8)
    batched = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched):
        alone = llm.generate(prompt, p)[0]
        assert out.token_ids == alone.token_ids
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
    assert all(n == 0 for n in llm.runner.kv_cache.lengths_np)  # every slot released


def test_unseeded_requests_differ(small_vocab_llm):
    outs = small_vocab_llm.generate([[5, 6, 7]] * 2, SamplingParams(temperature=1.0, max_tokens=8))
    assert outs[0].token_ids != outs[1].token_ids


def test_max_tokens_exact_and_max_model_len(llm):
    out = llm.generate([9, 10], SamplingParams(temperature=0, max_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # vLLM's rule (issue 48): prompt + max_tokens beyond max_model_len is an error naming both.
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 3))
    with pytest.raises(ValueError, match=f"max_tokens=50 and the prompt's {MAX_MODEL_LEN - 3} "
                                         f"tokens exceed max_model_len={MAX_MODEL_LEN}"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    base = llm.generate([11, 12, 13], SamplingParams(temperature=0, max_tokens=20))[0]
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    out = llm.generate([11, 12, 13], SamplingParams(temperature=0, max_tokens=20,
                                                    stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: first + 1]  # the stop token is kept in token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)


def test_eos_stops_unless_ignored(llm):
    base = llm.generate([21, 22], SamplingParams(temperature=0, max_tokens=12))[0]
    eos = base.token_ids[3]
    first = base.token_ids.index(eos)
    llm.eos_token_ids, saved = frozenset({eos}), llm.eos_token_ids
    try:
        out = llm.generate([21, 22], SamplingParams(temperature=0, max_tokens=12))[0]
        ignored = llm.generate([21, 22], SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True))[0]
    finally:
        llm.eos_token_ids = saved
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    assert ignored.token_ids == base.token_ids


def test_stop_string(llm):
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=24))[0]
    assert len(base.text) > 12
    stop = base.text[6:9]
    cut = base.text.index(stop)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:cut]
    # It ended on the token that completed the stop string: no token after it.
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    text_before = llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    assert stop not in text_before


def test_prompt_forms(llm):
    messages = [{"role": "user", "content": "Hi there"}]
    templated = llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    ids = llm.tokenizer.encode(templated, add_special_tokens=False)
    p = SamplingParams(temperature=0, max_tokens=4)
    a, b = llm.generate([messages, ids], p)
    assert a.prompt_token_ids == ids and a.token_ids == b.token_ids
    assert llm.generate("Hi there", p)[0].prompt == "Hi there"


def test_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt: one dict is one prompt, a list of them a batch; a key
    verispec does not read is refused by name, in a batch for that prompt alone."""
    p = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.tokenizer.encode("Hi there")
    by_text, by_ids = llm.generate("Hi there", p)[0], llm.generate(ids, p)[0]
    one = llm.generate({"prompt": "Hi there"}, p)
    assert len(one) == 1 and one[0].token_ids == by_text.token_ids
    assert one[0].prompt == "Hi there"
    a, b = llm.generate([{"prompt_token_ids": ids}, {"prompt": "Hi there"}], p)
    assert a.token_ids == by_ids.token_ids and b.token_ids == by_text.token_ids
    assert list(llm.generate_stream({"prompt_token_ids": ids}, p))[-1].token_ids == \
        by_ids.token_ids
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {}}, p)
    with pytest.raises(ValueError, match="got both"):
        llm.generate({"prompt": "Hi", "prompt_token_ids": ids}, p)
    with pytest.raises(ValueError, match="prompt_token_ids'] must be a list of token ids"):
        llm.generate({"prompt_token_ids": "Hi"}, p)
    good, bad = llm.generate([{"prompt": "Hi there"}, {"prompt": 5}], p)
    assert good.token_ids == by_text.token_ids
    assert bad.finish_reason == "error" and "prompt['prompt'] must be a string" in bad.error


def test_stream_matches_generate(llm):
    p = SamplingParams(temperature=0, max_tokens=16, stop=["zz"])
    final = llm.generate("Once upon", p)[0]
    chunks = list(llm.generate_stream("Once upon", p))
    texts = [c.text for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text only grows
    assert chunks[-1].text == final.text and chunks[-1].token_ids == final.token_ids
    assert chunks[-1].finish_reason == final.finish_reason


def test_streams_end_with_their_final_output_whatever_interleaves(llm):
    """Regression: a stream whose request finished during another stream's step, or during a
    generate() call made while it was open, ended without its final output (finish_reason None,
    tokens missing)."""
    p = SamplingParams(temperature=0, max_tokens=4)
    expected = llm.generate([5, 6, 7], p)[0].token_ids
    short = llm.generate_stream([5, 6, 7], p)
    long = llm.generate_stream([9, 8], SamplingParams(temperature=0, max_tokens=12))
    next(short)
    for _ in range(6):  # the long stream's steps finish the short request
        next(long)
    rest = list(short)
    assert rest and rest[-1].finish_reason == "length" and rest[-1].token_ids == expected
    other = llm.generate_stream([5, 6, 7], p)
    next(other)
    llm.generate([4, 4], SamplingParams(temperature=0, max_tokens=8))  # runs `other` to its end
    last = list(other)[-1]
    assert last.finish_reason == "length" and last.token_ids == expected
    assert list(long)[-1].finish_reason == "length"
    assert not llm.scheduler.has_unfinished


def test_stream_stopped_early_releases_its_slot(llm):
    stream = llm.generate_stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=30))
    next(stream)
    stream.close()
    assert not llm.scheduler.has_unfinished
    assert all(n == 0 for n in llm.runner.kv_cache.lengths_np)
    assert len(llm.generate([5, 6], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_metrics(llm):
    out = llm.generate([5, 6], SamplingParams(temperature=0, max_tokens=6))[0]
    m = out.metrics
    assert m.num_generated_tokens == 6
    assert 0 < m.time_to_first_token_s <= m.e2e_s
    assert m.tokens_per_s > 0


def test_bad_prompts_raise_one_clear_error(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="max_model_len=96"):
        llm.generate(list(range(5, 5 + MAX_MODEL_LEN)))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.generate([5, 49152])
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_invalid_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_bad_request_in_batch_does_not_stop_others(llm):
    good = SamplingParams(temperature=0, max_tokens=5)
    outs = llm.generate(
        ["fine", "", list(range(5, 5 + MAX_MODEL_LEN)), [7, 8], "fine too", "\ud800 x"],
        [good, good, good, {"top_p": 1.5}, good, good],
    )
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length",
                                               "error"]
    assert outs[1].error == "prompt 1: prompt is empty"  # each error names the prompt's index
    assert "max_model_len" in outs[2].error and outs[2].error.startswith("prompt 2: ")
    assert "top_p" in outs[3].error and "1.5" in outs[3].error
    assert outs[5].error.startswith("prompt 5: ") and "not valid Unicode" in outs[5].error
    assert len(outs[0].token_ids) == 5 and outs[1].token_ids == []


def test_load_errors(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))  # GGUF conversions go here
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    )
    with pytest.raises(ValueError, match=r"unsupported architecture.*LlamaForCausalLM"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n  oops}')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON: .* at line 2"):
        LLM(str(tmp_path))
    import shutil

    shutil.copy(f"{model_dir}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path))
    weights = next(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    with open(f"{model_dir}/{weights}", "rb") as f:
        data = f.read()
    for content in (data[: len(data) // 2], b"garbage" * 9):  # truncated, not safetensors
        (tmp_path / "model.safetensors").write_bytes(content)
        with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors"):
            LLM(str(tmp_path))
    for content in (b"GGUF\x03\x00\x00\x00" + b"garbage" * 5, b"notgguf" * 10):
        (tmp_path / "model.gguf").write_bytes(content)
        with pytest.raises(ValueError, match="model.gguf is not a readable GGUF file"):
            LLM(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="dtype"):
        LLM(model_dir, dtype="float64")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(model_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len=1000 exceeds"):
        LLM(model_dir, max_model_len=1000)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model_dir, speculative_config={"num_speculative_tokens": 0})


def test_speculative_config_is_stored(model_dir):
    llm = LLM(model_dir, max_model_len=32, max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert llm.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize("device", ["meta", "cuda", "cuda:7", "nonsense"])
def test_devices_that_cannot_run_are_refused_at_construction(device):
    """One ValueError naming the value, before any model is loaded (a CPU-only machine has no
    CUDA; 'meta' cannot run; 'cuda:7' does not exist here)."""
    if device.startswith("cuda") and torch.cuda.is_available() and device == "cuda":
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=f"device.*{device}"):
        LLM("/nonexistent/model/dir", device=device)


def test_numpy_and_float_token_ids_are_one_prompt(llm):
    """numpy integers are token ids (one prompt); floats are one error for the prompt, not a
    batch of per-token errors."""
    import numpy as np

    p = SamplingParams(temperature=0, max_tokens=3)
    expected = llm.generate([5, 6, 7], p)[0].token_ids
    assert llm.generate([np.int64(5), np.int32(6), np.int64(7)], p)[0].token_ids == expected
    assert llm.generate(np.array([5, 6, 7]), p)[0].token_ids == expected
    with pytest.raises(ValueError, match=r"must be integers in \[0, .*3\.0"):
        llm.generate([5, 6, 3.0], p)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab_size = llm.model_config.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids \\[{vocab_size}\\] are outside"):
        llm.generate([5, 6], SamplingParams(max_tokens=3, stop_token_ids=[vocab_size]))
