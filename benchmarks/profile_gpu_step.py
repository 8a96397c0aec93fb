"""Where the time of one GPU step goes: captured decode and verify steps of a random-weight
Llama-3.1-8B-shaped model, the batch-invariant Triton matmul against torch's (cuBLAS), and the
kernels of one step by share of its GPU time.

For each matmul (``--matmul triton`` is the default, batch invariant; ``cublas`` is torch's) and
batch size B: the median time of a captured decode step (B tokens) and verify step (B x (k + 1)
tokens, k = 3), against the weight-bandwidth floor (weight bytes / measured copy bandwidth).
Then the linear layers alone on the model's shapes at 1, 8, 64 and 256 rows, both matmuls, with
the achieved bandwidth; whether row 0 of a product is bit-identical at 1, 8, 64 and 256 rows
(batch invariance); and the kernels of one decode step at B = 1 with their share of the step
(torch profiler over an eager step); and (``mixed``) the kernels of a chunked-prefill step
(decodes beside a prompt chunk) against a whole-prompt step of as many tokens. Prints tables,
then one JSON line.

    python benchmarks/profile_gpu_step.py                # on the GPU machine
    python benchmarks/profile_gpu_step.py --layers 4     # a shallower model, quicker
    python benchmarks/profile_gpu_step.py --shape 1b     # the draft model's shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from verispec.models.config import ModelConfig
from verispec.models.llama import LlamaForCausalLM
from verispec.ops import model_ops
from verispec.runtime.model_runner import ModelRunner

K = 3


def llama8b(layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    )


def llama1b(layers: int) -> ModelConfig:
    """The Llama-3.2-1B shape (the end-to-end benchmark's draft model)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    )


SHAPES = {"8b": (llama8b, 32), "1b": (llama1b, 16)}
PARTS = ("steps", "linears", "sweep", "kernels", "mixed")


def random_model(config: ModelConfig, device) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a large device-to-device copy (median of 10)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def time_fn(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def step_times(model, batch_sizes, batch_invariant: bool, floor_s: float) -> list[dict]:
    runner = ModelRunner(model, max(batch_sizes), 512, "cuda", max_step_tokens=K + 1,
                         batch_invariant=batch_invariant)
    runner.capture([1, K + 1])
    rows = []
    for B in batch_sizes:
        for name, tokens in (("decode", 1), ("verify", K + 1)):
            graph = runner.graph_name(tokens)
            seconds = runner.graphs.time_step(graph, B)
            rows.append(dict(matmul="triton" if batch_invariant else "cublas", step=name, B=B,
                             ms=seconds * 1e3, x_floor=seconds / floor_s))
    rows.append(dict(matmul=rows[-1]["matmul"], step="capture", B=max(batch_sizes),
                     ms=runner.graphs.capture_time_s * 1e3, x_floor=None))
    del runner
    torch.cuda.empty_cache()
    return rows


def graph_time(fn, calls: int) -> float:
    """Median seconds of one ``fn()`` among ``calls`` captured in one CUDA graph (no launch
    overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_fn(graph.replay) / calls


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """[N, K] of each matmul of a layer, and the LM head."""
    H, inter = config.hidden_size, config.intermediate_size
    return {"qkv": (config.q_size + 2 * config.kv_size, H), "o": (H, config.q_size),
            "gate_up": (2 * inter, H), "down": (H, inter), "lm_head": (config.vocab_size, H)}


SWEEP = [(16, 16, 4, 8), (16, 32, 4, 6), (16, 64, 4, 4), (16, 128, 4, 4), (32, 32, 4, 6),
         (64, 16, 4, 6), (64, 32, 4, 6), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4),
         (128, 128, 8, 3), (128, 256, 8, 2), (128, 128, 4, 3),
         # 64 features per step: the same sum if the tensor cores add 16-feature slices in
         # order whatever block_k (same_bits says whether they do)
         (128, 256, 8, 3, 64), (128, 128, 8, 4, 64), (128, 128, 4, 4, 64), (64, 256, 8, 3, 64),
         (256, 128, 8, 3, 64), (64, 128, 4, 5, 64),
         # the same tiles loaded by the tensor-memory accelerator (Hopper)
         (16, 32, 4, 6, 128, True), (64, 32, 4, 6, 128, True), (64, 64, 4, 4, 128, True),
         (64, 128, 4, 4, 128, True), (128, 128, 8, 3, 128, True), (128, 256, 8, 2, 128, True),
         (128, 128, 8, 4, 64, True), (128, 256, 8, 3, 64, True), (256, 128, 8, 3, 64, True),
         (128, 128, 4, 4, 64, True), (64, 256, 8, 3, 64, True), (64, 128, 4, 5, 64, True)]


def sweep_rows(config: ModelConfig, bandwidth: float, device,
               row_counts=(1, 16, 64, 128, 256)) -> list[dict]:
    """Tiles (block_k 128, so every row's sum is the same) at 1, 16, 64, 128 and 256 rows:
    the fastest per weight shape and row count decides ``triton_model.LINEAR_TILES``;
    ``same_bits``: row 0 equals row 0 of the one-row product with ``linear_config``'s tile."""
    from verispec.ops import triton_model
    from verispec.ops.triton_model import LinearConfig

    shapes = weight_shapes(config)
    rows = []
    for name, (N, Kd) in shapes.items():
        copies = max(1, -(-400 * 2**20 // (N * Kd * 2)))
        ws = [torch.randn(N, Kd, device=device, dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        x = torch.randn(256, Kd, device=device, dtype=torch.bfloat16)
        reference = triton_model.linear(x[:1], ws[0])[0]
        for M in row_counts:
            best = None
            for tile in SWEEP:
                cfg = LinearConfig(*tile)
                try:
                    seconds = graph_time(lambda x=x[:M], ws=ws, cfg=cfg: [
                        triton_model.linear(x, w, config=cfg) for w in ws], 2) / copies
                except Exception as e:  # out of shared memory and the like
                    print(f"{name} M={M} {tile}: {type(e).__name__}")
                    continue
                same = torch.equal(triton_model.linear(x[:M], ws[0], config=cfg)[0], reference)
                row = dict(weight=name, M=M, tile=str(tile), us=seconds * 1e6,
                           x_floor=seconds / (N * Kd * 2 / bandwidth), same_bits=same)
                rows.append(row)
                if best is None or row["us"] < best["us"]:
                    best = row
            best["best"] = "*"
        del ws
    return rows


def linear_variants():
    from verispec.ops import triton_model

    return {"triton": triton_model.linear, "cublas": model_ops.linear}


def linear_rows(config: ModelConfig, bandwidth: float, device) -> tuple[list[dict], dict]:
    """Each weight shape at 1, 8, 64 and 256 rows, timed in CUDA graphs over enough copies of
    the weight that L2 cannot hold them."""
    from verispec.ops import triton_model

    shapes = weight_shapes(config)
    rows, invariant = [], {}
    for name, (N, Kd) in shapes.items():
        copies = max(1, -(-400 * 2**20 // (N * Kd * 2)))
        ws = [torch.randn(N, Kd, device=device, dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        x = torch.randn(256, Kd, device=device, dtype=torch.bfloat16)
        for label, fn in linear_variants().items():
            for M in (1, 8, 64, 256):
                seconds = graph_time(
                    lambda fn=fn, x=x[:M], ws=ws: [fn(x, w) for w in ws], 4) / copies
                tile = triton_model.linear_config(M, N, torch.bfloat16)
                rows.append(dict(weight=name, N=N, K=Kd, M=M, matmul=label,
                                 tile=f"{tile.block_m}x{tile.block_n}" if label == "triton"
                                 else "", us=seconds * 1e6,
                                 tb_s=N * Kd * 2 / seconds / 1e12,
                                 x_floor=seconds / (N * Kd * 2 / bandwidth)))
            first = [fn(x[:M], ws[0])[0] for M in (1, 8, 64, 65, 256)]
            invariant[f"{name}/{label}"] = all(torch.equal(first[0], f) for f in first[1:])
        del ws
    return rows, invariant


def kernel_shares(model, device, batch_size: int = 1, tokens: int = 1) -> list[dict]:
    """Kernels of one eager step of ``tokens`` new tokens for each of ``batch_size`` requests
    (flat layout; 1: decode, K + 1: verify) after 32 prompt tokens each, by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    runner = ModelRunner(model, batch_size, 512, device, max_step_tokens=max(tokens, K + 1),
                         enforce_eager=True)
    slots = list(range(batch_size))
    for slot in slots:
        runner.forward([slot], [list(range(32))], logits="none")
    logits = "all" if tokens > 1 else "last"
    for _ in range(3):
        runner.forward(slots, [[5] * tokens] * batch_size, logits=logits)
        for slot in slots:
            runner.kv_cache.truncate(slot, 32)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(slots, [[7] * tokens] * batch_size, logits=logits)
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            key = e.name[:60]
            totals[key] += e.device_time
            counts[key] += 1
    step = sum(totals.values())
    rows = [dict(kernel=k, launches=counts[k], us=t, share=t / step)
            for k, t in sorted(totals.items(), key=lambda kv: -kv[1])]
    rows.append(dict(kernel="TOTAL", launches=sum(counts.values()), us=step, share=1.0))
    return rows


def _profiled(runner, slots, tokens) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total microseconds, launches) of one eager ``runner.forward``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(slots, tokens)
        torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name[:60]][0] += e.device_time
            totals[e.name[:60]][1] += 1
    return {k: (v[0], v[1]) for k, v in totals.items()}


def mixed_step_shares(model, device, num_decodes: int, chunk: int,
                      context: int) -> list[dict]:
    """A chunked-prefill step against a whole-prompt step of as many tokens: ``num_decodes``
    one-token decodes (600 tokens cached each) beside a chunk of ``chunk`` prompt tokens after
    ``context`` cached ones, then one prompt of ``num_decodes + chunk`` tokens from position 0.
    Per kernel: microseconds in each step."""
    total = num_decodes + chunk
    runner = ModelRunner(model, num_decodes + 2, max(context + chunk, total) + 16, device,
                         enforce_eager=True,
                         num_blocks=(num_decodes * 640 + context + chunk + total) // 16 + 64)
    for slot in range(num_decodes):
        runner.forward([slot], [[3] * 600], logits="none")
    if context:
        runner.forward([num_decodes], [[4] * context], logits="none")
    slots = list(range(num_decodes + 1))
    tokens = [[5]] * num_decodes + [[6] * chunk]
    for _ in range(2):  # warm-up (kernels compiled), rolled back
        runner.forward(slots, tokens)
        for slot in range(num_decodes):
            runner.kv_cache.truncate(slot, 600)
        runner.kv_cache.truncate(num_decodes, context)
        runner.forward([num_decodes + 1], [[7] * total])
        runner.kv_cache.truncate(num_decodes + 1, 0)
    mixed = _profiled(runner, slots, tokens)
    whole = _profiled(runner, [num_decodes + 1], [[7] * total])
    names = sorted(set(mixed) | set(whole), key=lambda k: -mixed.get(k, (0, 0))[0])
    rows = [dict(kernel=k, mixed_us=mixed.get(k, (0.0, 0))[0],
                 whole_us=whole.get(k, (0.0, 0))[0]) for k in names]
    rows.append(dict(kernel="TOTAL", mixed_us=sum(v[0] for v in mixed.values()),
                     whole_us=sum(v[0] for v in whole.values())))
    return rows


def print_rows(rows: list[dict]) -> None:
    from verispec.bench.report import print_table

    print_table(rows)
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                        help="Llama-3.1-8B (the target) or Llama-3.2-1B (the draft) shapes")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                        help="what to measure (default: all)")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 16, 64, 128, 256],
                        help="row counts of the tile sweep")
    parser.add_argument("--kernel-batch", type=int, default=1,
                        help="requests of the step whose kernels are listed")
    parser.add_argument("--mixed", type=int, nargs=3, default=[115, 1933, 512],
                        metavar=("DECODES", "CHUNK", "CONTEXT"),
                        help="the chunked-prefill step of the 'mixed' part")
    parser.add_argument("--kernel-tokens", type=int, default=1,
                        help="new tokens per request of that step (K + 1: a verify step)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    make_config, default_layers = SHAPES[args.shape]
    config = make_config(args.layers or default_layers)
    model = random_model(config, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    floor_s = weight_bytes / bandwidth
    print(f"{args.shape}, {config.num_hidden_layers} layers; "
          f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"weights {weight_bytes / 1e9:.2f} GB, floor {floor_s * 1e3:.2f} ms per step")
    steps, linears, invariant, sweep, kernels = [], [], {}, [], []
    if "steps" in args.parts:
        for batch_invariant in (True, False):
            steps += step_times(model, args.batch_sizes, batch_invariant, floor_s)
        print_rows(steps)
    if "linears" in args.parts:
        linears, invariant = linear_rows(config, bandwidth, device)
        print_rows(linears)
        print("row 0 bit-identical at 1, 8, 64, 65, 256 rows:", invariant)
    if "sweep" in args.parts:
        sweep = sweep_rows(config, bandwidth, device, args.sweep_rows)
        print_rows(sweep)
    if "kernels" in args.parts:
        kernels = kernel_shares(model, device, args.kernel_batch, args.kernel_tokens)
        print_rows(kernels[:25] + kernels[-1:])
    mixed = []
    if "mixed" in args.parts:
        mixed = mixed_step_shares(model, device, *args.mixed)
        print_rows(mixed[:20] + mixed[-1:])
    print(json.dumps(dict(benchmark="profile_gpu_step", device=torch.cuda.get_device_name(),
                          copy_bandwidth_tb_s=bandwidth / 1e12, weight_gb=weight_bytes / 1e9,
                          floor_ms=floor_s * 1e3, steps=steps, linears=linears,
                          invariant=invariant, sweep=sweep, kernels=kernels[:40],
                          mixed=mixed[:40])))


if __name__ == "__main__":
    main()
