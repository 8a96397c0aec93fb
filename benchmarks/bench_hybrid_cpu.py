"""The Mamba2 + attention hybrid on CPU: plain decode against HF ``generate``, the cost of a verify
step, and synthetic speculation against the Leviathan prediction, in one run.

A random-weight GraniteMoeHybrid (dense) in the shape of granite-4.0-h-350m (hidden 768, 32
layers: 28 Mamba2 + 4 attention, 48 SSM heads of 32 x state 128, MLP 2048, vocabulary 100 352,
tied embeddings), built by transformers and saved once, so both systems run the same weights.
Batch 1, greedy, a random prompt of ``--prompt-len`` tokens.

- decode tokens/s: ``(T - 1) / (t(T) - t(1))`` with t(n) the time of a whole generate call of n
  new tokens (prefill and the first token cancel out); ours (``LLM.generate``) and HF
  ``generate`` on the same model and dtype, alternated ``--repeats`` times, medians;
- verify cost: a forward over k + 1 = 4 new tokens over a one-token forward, both from the same
  committed context (rolled back after each), medians of 3 x ``--repeats`` alternated pairs taken
  in the rounds of the generate calls; also the early-exit draft forward (first layer, final
  norm, LM head) over a one-token forward (c);
- synthetic speculation (k = 3, mean acceptance length 2.5, early-exit drafter of 1 layer):
  measured decode speedup over the plain engine, beside the prediction
  ``L / (k c + v)`` with the measured mean acceptance length L, draft cost c and verify cost v
  (Leviathan et al.'s expected tokens per step over cost per step; L replaces the geometric
  series because the synthetic schedule [1, 0.5, 0] is not geometric).

Prints a table, then one JSON line.

    python benchmarks/bench_hybrid_cpu.py
    python benchmarks/bench_hybrid_cpu.py --tokens 16 --repeats 2 --layers 8   # quicker, smaller
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from verispec import LLM, SamplingParams
from verispec.bench.report import machine_description, print_table

K = 3
ACCEPTANCE_LENGTH = 2.5


def granite_h_350m_like(num_layers: int, vocab_size: int) -> dict:
    """granite-4.0-h-350m's published shape (attention every 8th layer), random weights."""
    return dict(
        vocab_size=vocab_size, hidden_size=768, num_hidden_layers=num_layers,
        num_attention_heads=12, num_key_value_heads=4, shared_intermediate_size=2048,
        num_local_experts=0, max_position_embeddings=4096, position_embedding_type="nope",
        layer_types=["attention" if i % 8 == 7 else "mamba" for i in range(num_layers)],
        mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, embedding_multiplier=12.0,
        residual_multiplier=0.246, attention_multiplier=0.0078125, logits_scaling=3.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.1,
    )


def build(path: str, num_layers: int, vocab_size: int, dtype: torch.dtype):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **granite_h_350m_like(num_layers, vocab_size))).eval()
    model.save_pretrained(path)
    return model.to(dtype)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def matmul_timer():
    """Seconds spent inside the compiled weight-matmul kernels (``ops.cpu_kernels``) while
    the block runs, accumulated in the yielded one-element list."""
    from verispec.ops import cpu_kernels

    total = [0.0]
    originals = {name: getattr(cpu_kernels, name) for name in ("f32_linear", "bf16_linear")}

    def timing(kernel):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start
        return run

    for name, kernel in originals.items():
        setattr(cpu_kernels, name, timing(kernel))
    try:
        yield total
    finally:
        for name, kernel in originals.items():
            setattr(cpu_kernels, name, kernel)


def decode_rate(times_full: list[float], times_one: list[float], tokens: int) -> float:
    return (tokens - 1) / (statistics.median(times_full) - statistics.median(times_one))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per generate call")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=100352)
    args = parser.parse_args()
    for name in ("tokens", "prompt_len", "repeats", "layers", "vocab_size"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2")
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, args.vocab_size, size=args.prompt_len).tolist()

    with tempfile.TemporaryDirectory() as path:
        hf = build(path, args.layers, args.vocab_size, dtype)
        hf.generation_config.eos_token_id = None  # every call generates exactly n tokens
        plain = LLM(path, dtype=args.dtype, max_model_len=512, max_num_seqs=1)
        spec = LLM(path, dtype=args.dtype, max_model_len=512, max_num_seqs=1,
                   speculative_config={
                       "method": "early_exit", "num_draft_layers": 1,
                       "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
                       "synthetic_acceptance_length": ACCEPTANCE_LENGTH})
        state_bytes = spec.runner.kv_cache.state_nbytes

    ids = torch.tensor([prompt])

    def hf_call(n):
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)

    def ours(llm, n):
        return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                   ignore_eos=True))

    runner = spec.runner  # its state ring holds k + 2 lengths: a 4-token feed rolls back
    one, four, draft = [], [], []
    in_matmuls = {"one": [], "four": []}  # time inside the weight matmul kernels per forward

    def forwards() -> None:
        """Verify and draft forwards from one committed context (100 tokens), rolled back after
        each; the slot is freed afterwards for the engine's next request."""
        runner.forward([0], [prompt + prompt[:36]])
        length = runner.kv_cache.length(0)
        with matmul_timer() as matmul_s:
            for _ in range(3):
                for sink, feed, layers, name in ((one, prompt[:1], None, "one"),
                                                 (four, prompt[:4], None, "four"),
                                                 (draft, prompt[:1], 1, None)):
                    logits = "all" if len(feed) > 1 else "last"  # a verify step reads every row
                    before = matmul_s[0]
                    sink.append(timed(lambda f=feed, n=layers, lg=logits: runner.forward(
                        [0], [f], logits=lg, num_layers=n)))
                    if name is not None:
                        in_matmuls[name].append(matmul_s[0] - before)
                    runner.kv_cache.truncate(0, length)
        runner.kv_cache.free(0)

    hf_call(2), ours(plain, 2), ours(spec, 2)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in
                                      ("hf_T", "hf_1", "plain_T", "plain_1", "spec_T", "spec_1")}
    # The forwards run in the same rounds as the generate calls: on a shared machine whose
    # memory bandwidth drifts, the costs in the prediction and the measured speedup then come
    # from the same stretch of time.
    for _ in range(args.repeats):
        times["hf_T"].append(timed(lambda: hf_call(args.tokens)))
        times["hf_1"].append(timed(lambda: hf_call(1)))
        times["plain_T"].append(timed(lambda: ours(plain, args.tokens)))
        times["plain_1"].append(timed(lambda: ours(plain, 1)))
        times["spec_T"].append(timed(lambda: ours(spec, args.tokens)))
        times["spec_1"].append(timed(lambda: ours(spec, 1)))
        forwards()
    stats = spec.get_metrics()["spec_decoding"]
    verify_cost = statistics.median(four) / statistics.median(one)
    draft_cost = statistics.median(draft) / statistics.median(one)
    matmul_ms = {k: statistics.median(v) * 1e3 for k, v in in_matmuls.items()}

    hf_rate = decode_rate(times["hf_T"], times["hf_1"], args.tokens)
    plain_rate = decode_rate(times["plain_T"], times["plain_1"], args.tokens)
    spec_rate = decode_rate(times["spec_T"], times["spec_1"], args.tokens)
    acceptance_length = stats["mean_acceptance_length"]
    predicted = acceptance_length / (K * draft_cost + verify_cost)
    measured = spec_rate / plain_rate
    rows = [
        {"system": "HF generate (plain)", "decode tok/s": hf_rate, "x HF": 1.0},
        {"system": "verispec plain", "decode tok/s": plain_rate, "x HF": plain_rate / hf_rate},
        {"system": f"verispec synthetic k={K} L={ACCEPTANCE_LENGTH}",
         "decode tok/s": spec_rate, "x HF": spec_rate / hf_rate},
    ]
    print(f"machine: {machine_description()}; {args.dtype}, batch 1, greedy, prompt "
          f"{args.prompt_len} tokens, {args.tokens} new tokens, {args.layers} layers, "
          f"torch threads {torch.get_num_threads()}, medians of {args.repeats}")
    print_table(rows)
    print(f"verify of {K + 1} tokens: {verify_cost:.2f} one-token steps "
          f"({statistics.median(four) * 1e3:.1f} / {statistics.median(one) * 1e3:.1f} ms); "
          f"early-exit draft (1 layer + LM head): c = {draft_cost:.2f}")
    print(f"  of which in the weight matmul kernels: {matmul_ms['four']:.1f} / "
          f"{matmul_ms['one']:.1f} ms ({matmul_ms['four'] / matmul_ms['one']:.2f}x); the rest "
          f"(Mamba2 state updates, attention, norms): "
          f"{statistics.median(four) * 1e3 - matmul_ms['four']:.1f} / "
          f"{statistics.median(one) * 1e3 - matmul_ms['one']:.1f} ms")
    print(f"synthetic: mean acceptance length {acceptance_length:.2f}, speedup {measured:.2f}x "
          f"over plain, predicted L / (k c + v) = {predicted:.2f}x -> {measured / predicted:.0%} "
          "of the prediction")
    print(f"recurrent state at max_num_seqs=1, k={K}: {state_bytes} bytes "
          f"({state_bytes / 2**20:.1f} MiB)")
    print(json.dumps({
        "bench": "hybrid_cpu", "machine": machine_description(), "dtype": args.dtype,
        "layers": args.layers, "prompt_len": args.prompt_len, "tokens": args.tokens,
        "threads": torch.get_num_threads(), "hf_decode_tok_s": hf_rate,
        "plain_decode_tok_s": plain_rate, "plain_over_hf": plain_rate / hf_rate,
        "verify_4_over_1": verify_cost, "draft_cost_c": draft_cost,
        "verify_matmul_ms": matmul_ms["four"], "one_token_matmul_ms": matmul_ms["one"],
        "verify_ms": statistics.median(four) * 1e3, "one_token_ms": statistics.median(one) * 1e3,
        "synthetic_decode_tok_s": spec_rate, "synthetic_speedup": measured,
        "mean_acceptance_length": acceptance_length, "predicted_speedup": predicted,
        "fraction_of_prediction": measured / predicted, "state_bytes": state_bytes,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }))


if __name__ == "__main__":
    main()
