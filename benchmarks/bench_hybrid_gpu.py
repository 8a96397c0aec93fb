"""The Mamba2 + attention hybrid on one GPU: the captured decode and verify steps, the share of the
SSM state-update kernel, plain decoding and synthetic speculation, in one run.

A random-weight GraniteMoeHybrid (dense) in the shape of granite-4.0-h-350m (hidden 768, 32
layers: 28 Mamba2 + 4 attention, 48 SSM heads of 32 x state 128, MLP 2048, vocabulary 100 352,
tied embeddings; ``bench_hybrid_cpu.granite_h_350m_like``), built by transformers and saved with
``save_pretrained`` into ``--workdir`` (reused when it holds one) or a temporary directory; no
tokenizer, prompts are random token ids. All greedy, ``ignore_eos``, bfloat16 weights (the
recurrent states are float32).

- memory: the bytes of the per-position recurrent states (every Mamba2 layer, ring of k + 2
  positions per slot) at ``max_num_seqs`` = 64 and k = 3, as the engine logs them at start-up;
- steps: the captured decode (1 token per request) and verify (k + 1 = 4) graphs of the
  speculative engine replayed at batch 1 and 64, from a context of ``PROMPT_LEN + 96`` tokens
  (``CUDAGraphRunner.time_step``, medians), their ratio, and the SSM state update's share of
  each: the kernel of every Mamba2 layer on the step's shapes and the runner's own state rings,
  timed as one CUDA graph;
- runs: batch 1 (256 new tokens) and batch 64 (128 each) after ``PROMPT_LEN`` prompt tokens,
  plain against synthetic speculation (k = 3, mean acceptance length 2.5; the early-exit drafter
  through the first layer does the real drafting work, captured as a graph): decode tokens/s
  (after the first token), the speedup, and the Leviathan prediction ``L / cost`` with the
  measured mean acceptance length L and the engine's cost of a speculative step in decode steps
  (``SpeculativeDecoder.costs``, measured from the graphs at start-up).

Prints tables, then one JSON line.

    python benchmarks/bench_hybrid_gpu.py                                   # on the GPU machine
    python benchmarks/bench_hybrid_gpu.py --workdir /tmp/hybrid --quick     # shorter runs
    python benchmarks/bench_hybrid_gpu.py --tiny --device cpu --quick       # smoke run (CPU path)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hybrid_cpu import granite_h_350m_like  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench.report import machine_description, print_table  # noqa: E402

K = 3
ACCEPTANCE_LENGTH = 2.5
PROMPT_LEN = 32
BATCH = 64
MAX_MODEL_LEN = 512
DRAFT_LAYERS = 1


def model_config(tiny: bool) -> dict:
    """GraniteMoeHybridConfig keyword arguments (``--tiny``: 4 layers of hidden 64)."""
    config = granite_h_350m_like(32, 100352)
    if tiny:
        config.update(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, shared_intermediate_size=128, mamba_n_heads=8,
                      mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
                      layer_types=["mamba", "attention", "mamba", "mamba"])
    config["eos_token_id"] = None  # our runs ignore EOS; no token ends a request early
    return config


def checkpoint(workdir: str, tiny: bool) -> str:
    """The checkpoint's directory, built (random weights, bfloat16 safetensors) unless
    ``workdir`` already holds one of this shape."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kwargs = model_config(tiny)
    path = os.path.join(workdir, "tiny" if tiny else "granite-4.0-h-350m-like")
    config_path = os.path.join(path, "config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            saved = json.load(f)
        keys = ("hidden_size", "num_hidden_layers", "vocab_size", "mamba_n_heads")
        if all(saved.get(key) == kwargs[key] for key in keys):
            return path
    torch.manual_seed(0)
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**kwargs)).eval()
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(path: str, device: torch.device, dtype: str, spec: bool) -> LLM:
    config = None if not spec else {
        "method": "early_exit", "num_draft_layers": DRAFT_LAYERS, "num_speculative_tokens": K,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": ACCEPTANCE_LENGTH}
    return LLM(path, device=device, dtype=dtype, max_num_seqs=BATCH,
               max_model_len=MAX_MODEL_LEN, speculative_config=config)


# ----------------------------------------------------------------- captured steps


def median_seconds(fn, repeats: int, device: torch.device) -> float:
    """Median wall seconds of ``fn()`` (the CPU path, where there are no graphs to replay)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ssm_update_seconds(runner, slots: list[int], num_queries: int, repeats: int) -> float:
    """Seconds of the SSM state update of every Mamba2 layer for a step of ``num_queries``
    tokens per request of ``slots``, on the runner's own rings (the step's shapes): one CUDA
    graph of all the layers' launches on the GPU, the torch twin timed eagerly elsewhere."""
    from verispec.ops.backend import get_backend

    cache, device = runner.kv_cache, runner.device
    config = runner.config
    G, S = len(slots), num_queries
    H, P, N = config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    slot_ids = torch.tensor(slots, dtype=torch.int64, device=device)
    starts = torch.from_numpy(cache.lengths_np[slots].copy()).to(device)
    counts = torch.full((G,), S, dtype=torch.int64, device=device)
    operands = (rand(S, G, H, P), rand(S, G, H, N, scale=0.1),
                torch.rand(S, G, H, generator=gen).to(device), rand(S, G, H, N))
    update = get_backend(device).model_ops().ssm_state_update
    rings = [state.ssm for state in cache.states]

    def all_layers():
        for ring in rings:
            update(ring, slot_ids, starts, counts, *operands)

    if device.type != "cuda":
        return median_seconds(all_layers, repeats, device)
    all_layers()  # compile
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_layers()
    return median_seconds(graph.replay, repeats, device)


def step_rows(llm: LLM, batch_sizes: list[int], repeats: int, rng) -> list[dict]:
    """Decode and verify step times of the speculative engine's target (see the module
    docstring); its slots are filled with a context, stepped once per graph (so the graph's
    static inputs are real requests), timed, then freed."""
    runner, device = llm.runner, llm.runner.device
    graphs = runner.graphs if runner.graphs is not None and runner.graphs.capture_graphs \
        else None
    vocab = llm.model_config.vocab_size
    rows = []
    for B in batch_sizes:
        slots = list(range(B))
        context = rng.integers(3, vocab, size=(B, PROMPT_LEN + 96)).tolist()
        runner.forward(slots, context, logits="none")
        length = runner.kv_cache.lengths_np[slots].copy()
        row = {"B": B}
        for name, width in (("decode", 1), ("verify", K + 1)):
            feed = rng.integers(3, vocab, size=(B, width)).tolist()

            def step(feed=feed, slots=slots, length=length):
                runner.forward(slots, feed, logits="all")
                for slot, n in zip(slots, length):
                    runner.kv_cache.truncate(slot, int(n))

            step()  # the graph's static inputs now hold these requests
            if graphs is not None:
                seconds = graphs.time_step(runner.graph_name(width), B, repeats)
            else:
                seconds = median_seconds(step, repeats, device)
            ssm = ssm_update_seconds(runner, slots, width, repeats)
            row[f"{name}_us"] = 1e6 * seconds
            row[f"{name}_ssm_us"] = 1e6 * ssm
            row[f"{name}_ssm_pct"] = 100 * ssm / seconds
        row["verify_x_decode"] = row["verify_us"] / row["decode_us"]
        rows.append(row)
        for slot in slots:
            runner.kv_cache.free(slot)
    return rows


# ----------------------------------------------------------------- generate runs


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int, label: str) -> dict:
    """One timed ``generate``: decode tokens/s after every request's first token."""
    device = llm.runner.device
    spec = llm.spec
    before = None if spec is None else (spec.stats.num_drafts, spec.stats.num_accepted_tokens)
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(max_tokens))
    sync(device)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    decode_s = seconds - max(o.metrics.time_to_first_token_s for o in outputs)
    row = dict(run=label, B=len(prompts), tokens=num_tokens, seconds=seconds,
               decode_tok_s=(num_tokens - len(prompts)) / decode_s)
    if spec is not None:
        drafts = spec.stats.num_drafts - before[0]
        accepted = spec.stats.num_accepted_tokens - before[1]
        row["accept_len"] = 1.0 + accepted / max(drafts, 1)
        row["step_cost"] = spec.costs[-1]  # a step with k drafts, in decode steps
        row["predicted"] = row["accept_len"] / spec.costs[-1]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="a 4-layer model (smoke runs)")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--workdir", help="where the checkpoint is built (and reused)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (use --device cpu --tiny for a smoke run)")
    tokens_b1, tokens_batch = (16, 8) if args.quick else (256, 128)
    batch = 4 if args.quick else BATCH
    repeats = 3 if args.quick else 20
    rng = np.random.default_rng(0)

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.workdir or tmp, args.tiny)
        plain = make_llm(path, device, args.dtype, spec=False)
        spec = make_llm(path, device, args.dtype, spec=True)
    cache = spec.runner.kv_cache
    memory = dict(max_num_seqs=BATCH, k=K, ring_positions=cache.ring_size,
                  mamba_layers=len(cache.states), position_bytes=cache.position_nbytes,
                  state_bytes=cache.state_nbytes, kv_cache_bytes=cache.nbytes - cache.state_nbytes)
    print(f"{machine_description()}; {args.dtype}, {'tiny' if args.tiny else 'granite-4.0-h-350m'}"
          f"-like, {args.device}")
    print(f"recurrent state per slot and position: {memory['position_bytes']} bytes; at "
          f"max_num_seqs={BATCH}, k={K} ({cache.ring_size} positions per slot): "
          f"{memory['state_bytes'] / 2**20:.1f} MiB (attention KV cache "
          f"{memory['kv_cache_bytes'] / 2**20:.1f} MiB)")
    graphs = spec.runner.graphs
    if graphs is not None and graphs.capture_graphs:
        print(f"CUDA graphs captured in {graphs.capture_time_s:.1f} s, "
              f"{graphs.memory_bytes / 2**20:.0f} MiB; speculative step cost "
              f"{spec.spec.costs[-1]:.2f} decode steps")

    steps = step_rows(spec, [1, batch], repeats, rng)
    print_table(steps, ["B", "decode_us", "verify_us", "verify_x_decode", "decode_ssm_us",
                        "decode_ssm_pct", "verify_ssm_us", "verify_ssm_pct"], ".1f")

    vocab = plain.model_config.vocab_size
    prompts = rng.integers(3, vocab, size=(batch, PROMPT_LEN)).tolist()
    for llm in (plain, spec):  # warm-up
        llm.generate(prompts[:1], greedy(4))
        llm.generate(prompts, greedy(4))
    runs = []
    for B, max_tokens in ((1, tokens_b1), (batch, tokens_batch)):
        plain_row = timed_generate(plain, prompts[:B], max_tokens, f"b{B} plain")
        spec_row = timed_generate(spec, prompts[:B], max_tokens, f"b{B} synthetic")
        spec_row["speedup"] = spec_row["decode_tok_s"] / plain_row["decode_tok_s"]
        spec_row["measured_x_predicted"] = spec_row["speedup"] / spec_row["predicted"]
        runs += [plain_row, spec_row]
    print_table(runs, ["run", "B", "tokens", "decode_tok_s", "accept_len", "step_cost",
                       "speedup", "predicted", "measured_x_predicted"])

    result = dict(benchmark="bench_hybrid_gpu", machine=machine_description(),
                  device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, dtype=args.dtype, tiny=args.tiny, k=K,
                  synthetic_acceptance_length=ACCEPTANCE_LENGTH, draft_layers=DRAFT_LAYERS,
                  prompt_len=PROMPT_LEN, memory=memory, steps=steps, runs=runs)
    line = json.dumps(result)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
