"""A GGUF model loaded with its weights kept quantised (``verispec.models.gguf_quant``).

Strategy: a tiny random Llama is written with the ``gguf`` package, its matrices in every kept
type (q Q4_K, k Q4_0, v Q6_K, o Q5_K, gate Q4_1, up Q4_K, down Q6_K, a tied Q8_0 embedding), and
loaded twice: quantised (the default on the CPU) and dequantised to float32 (``dtype``
given). Every quantised matrix must dequantise to the float32 model's parameter exactly (the
fusions, the q/k row order and the tied head are the loader's), the logits agree within float32
summation error, and on the quantised model greedy n-gram speculation and batching leave the
plain greedy tokens unchanged (batch invariance). The bundled model's quantised greedy tokens
are checked against its float32 ones on chat prompts.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch

from tests.models.utils import bundled_llm, requires_bundled
from verispec import LLM, SamplingParams
from verispec.models.loader import load_model
from verispec.ops import cpu_kernels
from verispec.ops.quant import QuantizedWeight

gguf = pytest.importorskip("gguf")
trainer = importlib.import_module("verispec.train.train_draft")  # the module, not the function
eagle3 = importlib.import_module("verispec.train.eagle3")
pytestmark = pytest.mark.skipif(not cpu_kernels.quant_available(),
                                reason="the quantised kernel needs AVX-512")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 3, 4, 2, 512  # 3: an EAGLE-3 head
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q5_K",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantized(rng, qtype: str, rows: int, cols: int) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in BLOCK_BYTES:
        return gguf.quants.quantize(
            (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), kind)
    num_blocks = rows * cols // 256
    blocks = rng.integers(0, 256, (num_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = (rng.random((num_blocks, 2)) * 0.004).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[:, 208:210] = scales[:, :2]
    else:
        blocks[:, 0:4] = scales
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[str, str]:
    """The tiny GGUF file, and a cache directory of its own for its converted copies."""
    path = str(tmp_path_factory.mktemp("model") / "tiny.gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(2)

    def add(name, qtype, rows, cols):
        w.add_tensor(name, quantized(rng, qtype, rows, cols),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])

    add("token_embd.weight", "Q8_0", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for layer in range(LAYERS):
        for kind, (rows, cols) in shapes.items():
            add(f"blk.{layer}.{kind}.weight", TYPES[kind], rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight",
                         (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def gguf_path(tiny_gguf, monkeypatch) -> str:
    """The tiny GGUF, its conversions kept out of the user's cache. Set per test: the bundled
    model's tests below use the usual cache, where its float32 copy is converted once."""
    path, cache = tiny_gguf
    monkeypatch.setenv("VERISPEC_CACHE", cache)
    return path


def test_quantised_weights_are_the_dequantised_models(gguf_path):
    quant = load_model(gguf_path, dtype=None).model
    dense = load_model(gguf_path, dtype="float32").model
    assert isinstance(quant.layers[0].attn.qkv_weight, QuantizedWeight)
    assert quant.lm_head_weight is quant.embed_weight  # tied
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    checked = 0
    for name, module in quant.named_modules(remove_duplicate=False):
        if isinstance(module, QuantizedWeight):
            assert torch.equal(module.dequantize(), dense_params[name]), name
            checked += 1
    assert checked == 2 + 4 * LAYERS  # embedding, tied head, then qkv, o, gate_up, down
    for name, p in quant.named_parameters():
        assert torch.equal(p, dense_params[name]), name


def test_logits_agree_with_the_float32_model(gguf_path):
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = {}
    for dtype in (None, "float32"):
        llm = LLM(gguf_path, dtype=dtype, max_model_len=128, max_num_seqs=1)
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        logits[dtype] = llm.generate(ids[0].tolist(), params)[0]
    a, b = logits[None], logits["float32"]
    assert a.token_ids == b.token_ids
    shared = set(a.logprobs[0]) & set(b.logprobs[0])
    assert a.token_ids[0] in shared
    for token in shared:
        assert a.logprobs[0][token] == pytest.approx(b.logprobs[0][token], abs=1e-4)


def test_greedy_speculation_and_batching_keep_plain_greedy(gguf_path):
    """Repetitive prompts so that n-gram drafts are proposed and accepted."""
    gen = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).tolist() * 4) for n in (5, 9, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(gguf_path, max_model_len=128, max_num_seqs=3)
    alone = [plain.generate(p, params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in plain.generate(prompts, params)] == alone
    spec = LLM(gguf_path, max_model_len=128, max_num_seqs=3, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert [o.token_ids for o in spec.generate(prompts, params)] == alone
    assert spec.get_metrics()["spec_decoding"]["num_drafts"] > 0


def test_train_draft_reads_the_quantised_model(gguf_path, tmp_path):
    """``train-draft`` on a GGUF at its default dtype trains on the quantised model (the one the
    head will draft for): the head starts from the dequantised target layer and LM head, and a
    greedy EAGLE-3 run over the quantised target with it gives the plain greedy tokens."""
    quant = load_model(gguf_path, dtype=None).model
    dense = load_model(gguf_path, dtype="float32").model
    head = trainer.EagleHead(trainer._head_config(quant.config, 64),
                             eagle3.dense(quant.embed_weight))
    weights = eagle3.copyable_layer(quant, 1, head)
    layer = dense.layers[1]
    assert all(torch.equal(a, b) for a, b in zip(weights, (
        layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
        layer.mlp.down_weight, layer.input_norm.weight, layer.post_attn_norm.weight)))

    gen = torch.Generator().manual_seed(2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt_token_ids": torch.randint(3, VOCAB, (6,), generator=gen).tolist()})
        + "\n" for _ in range(8)))
    out = tmp_path / "head"
    summary = trainer.train_draft(trainer.TrainDraftConfig(
        output_dir=str(out), model=gguf_path, prompts=str(prompts), max_new_tokens=12,
        temperature=0.0, draft_vocab_size=64, ttt_steps=2, epochs=1, batch_size=4,
        warmup_steps=1, max_num_seqs=4), log=lambda _: None)
    assert summary["sequences"] == 8 and summary["target_weights"] == "quantised"
    ids = torch.randint(3, VOCAB, (7,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(gguf_path, max_model_len=128, max_num_seqs=1).generate(ids, params)[0]
    spec = LLM(gguf_path, max_model_len=128, max_num_seqs=1, speculative_config={
        "method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    assert spec.generate(ids, params)[0].token_ids == plain.token_ids


def test_compiled_decoder_gives_the_per_op_bits(gguf_path):
    """Every forward of a batched n-gram run (long and short prefills, decodes, verify steps of
    several tokens, padded rows) through the compiled decoder (``ops.cpu_decoder``) and through
    the per-op layers from the same caches: the same final hidden states and the same KV cache
    afterwards, bit for bit; also with early exit (one layer) and captured layers (an EAGLE
    head's inputs). Regression: RoPE's sum rounded separately instead of torch's addcmul FMA
    differed in one element in a few hundred."""
    llm = LLM(gguf_path, max_model_len=256, max_num_seqs=3, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    model = llm.runner.model
    decoder = model.quant_decoder
    assert decoder is not None
    real, shapes = model.forward, []

    def run(use, caches, saved, *args):
        for cache, state in zip(caches, saved):
            cache.copy_(state)
        model.quant_decoder = decoder if use else None
        try:
            out = real(*args)
        finally:
            model.quant_decoder = decoder
        return out, [c.clone() for c in caches]

    def both(input_ids, meta, k_caches, v_caches, num_layers=None, capture_layers=()):
        caches = [*k_caches, *v_caches]
        saved = [c.clone() for c in caches]
        for variant in ((1, ()), (None, (0, 1)), (num_layers, capture_layers)):
            args = (input_ids, meta, k_caches, v_caches, *variant)
            want, want_caches = run(False, caches, saved, *args)
            got, got_caches = run(True, caches, saved, *args)
            for a, b in zip(torch.utils._pytree.tree_leaves(got),
                            torch.utils._pytree.tree_leaves(want)):
                assert torch.equal(a, b)
            assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
        shapes.append(tuple(input_ids.shape))
        return got

    model.forward = both
    gen = torch.Generator().manual_seed(2)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).tolist() * 4) for n in (5, 9, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, params)
    assert llm.get_metrics()["spec_decoding"]["num_drafts"] > 0
    assert any(b > 1 and s > 1 for b, s in shapes)  # verify steps of several requests
    assert any(b * s >= 128 for b, s in shapes)  # a prefill long enough to use every thread
    assert LLM(gguf_path, dtype="float32", max_model_len=128,
               max_num_seqs=1).runner.model.quant_decoder is None  # dense weights: per op


@requires_bundled
@pytest.mark.slow
def test_bundled_quantised_greedy_agrees_with_float32():
    """The bundled Q4_1 model: the same greedy tokens as its float32 dequantised copy on chat
    prompts (the weights are the same numbers; only the summation order differs)."""
    prompts = [[{"role": "user", "content": text}] for text in (
        "What is the capital of France?", "Write a haiku about the sea.",
        "Add a docstring to: def add(a, b): return a + b", "List three prime numbers.")]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    quant = LLM(max_model_len=512, max_num_seqs=4)
    assert isinstance(quant.runner.model.embed_weight, QuantizedWeight)
    dense = bundled_llm()  # the session's float32 engine
    assert ([o.token_ids for o in quant.generate(prompts, params)]
            == [o.token_ids for o in dense.generate(prompts, params)])


@requires_bundled
def test_cached_gguf_tokenizer_is_autotokenizers():
    """A GGUF's cached directory loads its tokenizer by the class its tokenizer_config names
    (no AutoTokenizer lookup, ~1 s of start): the same class, ids, chat text and decoded text
    as AutoTokenizer gives."""
    from transformers import AutoTokenizer

    from verispec.models import gguf as gguf_files
    from verispec.models.loader import _load_hf_tokenizer

    model_dir = gguf_files.gguf_meta_dir(gguf_files.bundled_gguf_path())
    assert gguf_files.cached_tokenizer_class(model_dir) is not None
    fast, auto = _load_hf_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(fast) is type(auto)
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    assert fast.get_vocab() == auto.get_vocab()
    chat = [{"role": "user", "content": "Add a docstring to: def f(x): return x * 2 <|im_end|>"}]
    text = fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = fast.encode(text, add_special_tokens=False)
    assert ids == auto.encode(text, add_special_tokens=False)
    assert fast.encode("héllo wörld") == auto.encode("héllo wörld")
    assert (fast.decode(ids, skip_special_tokens=True)
            == auto.decode(ids, skip_special_tokens=True))
