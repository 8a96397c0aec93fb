"""Tensor parallelism on several GPUs: plain and speculative decode against the roofline.

Random weights made on the devices from a ``config.json`` alone (``load_format="dummy"``), so
no checkpoint is written: Llama-3.1-8B and Llama-3.1-70B shapes (the 70B cut to ``--layers-70b``
layers where the cards cannot hold all 80 with KV for a batch of 64), a Llama-3.2-1B-shaped
draft model, and an EAGLE-3 head (``--eagle``; synthetic acceptance, as ``bench_gpu_e2e``).

For each (shape, TP size, proposer): greedy decode of ``--max-tokens`` tokens at batch 1 and
batch 64 (random 128-token prompts), decode tokens/s after every request's first token. The
roofline of TP = n is one pass over a rank's weights (its slices: ``sum of parameter bytes`` of
rank 0's model, the vocabulary-parallel embedding and LM head included) at the measured copy
bandwidth of one GPU, B tokens per pass. Also whether TP = n tokens alone equal them batched.
(Dummy weights are made per rank's slice, so TP = 1 and TP = n hold different random weights and
their tokens are not compared here; ``tests/runtime/test_tensor_parallel.py`` compares them on
a checkpoint.)

    python benchmarks/bench_tensor_parallel.py --tp-sizes 1,2 --shapes 8b,70b --draft

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue as queue_module
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_e2e  # noqa: E402
import random_checkpoints  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench.report import print_device_profile, print_host_profile  # noqa: E402
from verispec.models.parallel import ALL_REDUCE_ENV  # noqa: E402

ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)
SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, intermediate_size=28672, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True),
    # host-side runs on a CPU (bench_options --shapes tiny): steps of a few milliseconds
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True),
}
K = 3
ACCEPTANCE_LENGTH = 2.5
PROMPT_LEN = 128


def write_config(workdir: str, name: str, layers: int | None = None) -> str:
    """A directory holding only the ``config.json`` of a shape (dummy weights need no more)."""
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    path = os.path.join(workdir, f"{name}-l{shape['num_hidden_layers']}")
    os.makedirs(path, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                  max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                  rope_scaling=dict(ROPE), torch_dtype="bfloat16", **shape)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def rank_weight_bytes(llm: LLM) -> int:
    seen, total = set(), 0
    for p in llm.runner.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def make_llm(model_dir: str, tp: int, args, spec: dict | None) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", load_format="dummy",
              tensor_parallel_size=tp, max_num_seqs=args.batch, max_model_len=args.max_model_len,
              speculative_config=spec, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=False)
    return llm, time.perf_counter() - start


def decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    first = max(o.metrics.time_to_first_token_s for o in outputs)
    tokens = sum(len(o.token_ids) for o in outputs)
    row = dict(B=len(prompts), decode_tok_s=(tokens - len(prompts)) / (seconds - first),
               ttft_ms=1e3 * first)
    stats = llm.get_metrics()["spec_decoding"]
    if stats is not None:
        row["accept_len"] = stats.get("mean_acceptance_length")
    return row, [o.token_ids for o in outputs]


def run_config(rows: list, label: str, model_dir: str, tp: int, args, spec,
               bandwidth, all_reduce: str = "") -> None:
    """One engine's rows, measured in a process of its own (its ranks' process group goes
    with it: closing a CUDA tensor-parallel engine can hang in NCCL's teardown, see
    docs/design.md §14)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_run_config_child,
                            args=(queue, label, model_dir, tp, args, spec, bandwidth,
                                  all_reduce))
    child.start()
    while True:
        try:
            row = queue.get(timeout=1.0)
        except queue_module.Empty:
            if not child.is_alive():
                break
            continue
        if row is None:
            break
        rows.append(row)
        print(json.dumps(row), flush=True)
    child.join(30)
    if child.is_alive():
        child.kill()
    if child.exitcode not in (0, None):
        print(f"{label} TP={tp}: the engine's process exited with code {child.exitcode}",
              flush=True)


def _run_config_child(queue, label, model_dir, tp, args, spec, bandwidth, all_reduce) -> None:
    rows: list = []
    try:
        measure_config(rows, queue, label, model_dir, tp, args, spec, bandwidth, all_reduce)
    except BaseException as e:  # noqa: BLE001 - reported here, the next config runs
        traceback.print_exc()
        print(f"{label} TP={tp}: {type(e).__name__}: {e}", flush=True)
    finally:
        queue.put(None)
        queue.close()
        queue.join_thread()
        sys.stdout.flush()
        os._exit(0)  # no teardown: the spawned ranks exit with this process


def measure_config(rows: list, queue, label: str, model_dir: str, tp: int, args, spec,
                   bandwidth, all_reduce: str = "") -> None:
    if all_reduce:
        os.environ[ALL_REDUCE_ENV] = all_reduce
    llm, startup = make_llm(model_dir, tp, args, spec)
    weights = rank_weight_bytes(llm)
    pool = llm.kv_plan
    prompts = bench_gpu_e2e.random_prompts(args.batch, 128256, seed=1, length=PROMPT_LEN)
    for batch in args.batch_sizes:  # every kernel and graph the measured runs take, compiled
        bench_gpu_e2e.warm_up(llm, prompts[:batch])
    for batch in args.batch_sizes:
        row, _ = decode(llm, prompts[:batch], args.max_tokens)
        step_s = weights / bandwidth
        path = ("fused" if llm._tp.fused is not None else
                "peer" if llm._tp.peer is not None else "nccl") if tp > 1 else "-"
        row.update(run=label, tp=tp, all_reduce=path, startup_s=startup,
                   rank_weight_gb=weights / 1e9, roofline_tok_s=batch / step_s,
                   kv_tokens=pool.num_blocks * pool.block_size)
        row["roofline_pct"] = 100 * row["decode_tok_s"] / row["roofline_tok_s"]
        if batch == 1 and spec is None:
            alone = [llm.generate([p], SamplingParams(
                temperature=0.0, max_tokens=32, ignore_eos=True))[0].token_ids
                     for p in prompts[:4]]
            batched = [o.token_ids for o in llm.generate(prompts[:4], SamplingParams(
                temperature=0.0, max_tokens=32, ignore_eos=True))]
            row["alone_eq_batched"] = alone == batched
        rows.append(row)
        queue.put(row)
    if args.profile:
        profile_step(llm, prompts[0], f"{label} TP={tp}", args)


def profile_step(llm: LLM, prompt: list[int], label: str, args) -> None:
    """Rank 0's kernels (graph replays included) and host functions over a batch-1 greedy
    decode of ``--profile`` tokens, per output token."""
    n = args.profile
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate([prompt], params)  # the same lengths' graphs and kernels, warm
    print_device_profile(f"{label}, batch 1, {n} tokens", lambda: llm.generate([prompt], params),
                         per=n)
    print_host_profile(f"{label}, batch 1, {n} tokens", lambda: llm.generate([prompt], params),
                       rows=25)


def add_speedups(rows: list) -> None:
    """Speculative rows over plain at the same (shape, TP, batch, all-reduce); TP > 1 plain rows
    over TP = 1."""
    def key(r):
        return r["run"].split("+")[0], r["tp"], r["B"], r["all_reduce"]
    plain = {key(r): r["decode_tok_s"] for r in rows if "+" not in r["run"]}
    one = {(r["run"], r["B"]): r["decode_tok_s"] for r in rows if r["tp"] == 1 and "+" not in
           r["run"]}
    for r in rows:
        base = plain.get(key(r))
        if "+" in r["run"] and base:
            r["speedup"] = r["decode_tok_s"] / base
        if "+" not in r["run"] and r["tp"] > 1 and (r["run"], r["B"]) in one:
            r["vs_tp1"] = r["decode_tok_s"] / one[(r["run"], r["B"])]


def print_table(rows: list) -> None:
    cols = ["run", "tp", "all_reduce", "B", "decode_tok_s", "roofline_pct", "vs_tp1", "speedup",
            "accept_len", "alone_eq_batched", "rank_weight_gb", "kv_tokens", "startup_s"]
    print(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        print(" | ".join(cells))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/bench_tp")
    parser.add_argument("--shapes", default="8b", help="comma list of 8b, 70b")
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--layers-70b", default="auto",
                        help="layers of the 70B shape (auto: all 80 where the TP group's "
                             "cards hold 200 GB or more, else 60)")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--batch", type=int, default=64, help="max_num_seqs")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--draft", action="store_true", help="also a 1B-shaped draft model")
    parser.add_argument("--eagle", action="store_true", help="also an EAGLE-3 head")
    parser.add_argument("--spec-shapes", default=None,
                        help="shapes that get the speculative runs (default: all)")
    parser.add_argument("--all-reduce", default="fused",
                        help="comma list of the TP > 1 all-reduce paths to run plain decode "
                             "with: fused (peer-to-peer, fused with the next norm), peer, nccl; "
                             "speculative runs take the first")
    parser.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                        help="also profile rank 0 over a batch-1 decode of TOKENS tokens: "
                             "kernels and host functions per token")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device("cuda")
    bandwidth = bench_gpu_e2e.copy_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    print(f"device: {torch.cuda.device_count()} x {name}; torch {torch.__version__}; copy "
          f"bandwidth {bandwidth / 1e9:.0f} GB/s per GPU", flush=True)
    os.makedirs(args.workdir, exist_ok=True)
    card_bytes = torch.cuda.get_device_properties(device).total_memory

    def layers_70b(tp: int) -> int:
        if args.layers_70b != "auto":
            return int(args.layers_70b)
        return 80 if card_bytes * tp >= 200e9 else 60

    modes = args.all_reduce.split(",")
    draft_dir = write_config(args.workdir, "1b")
    rows: list = []
    spec_shapes = (args.shapes if args.spec_shapes is None else args.spec_shapes).split(",")
    for shape in args.shapes.split(","):
        for tp in [int(t) for t in args.tp_sizes.split(",")]:
            if shape == "70b" and tp == 1:
                continue  # does not fit one card
            layers = layers_70b(tp) if shape == "70b" else None
            model_dir = write_config(args.workdir, shape, layers)
            label = os.path.basename(model_dir)
            for mode in modes if tp > 1 else [""]:
                run_config(rows, label, model_dir, tp, args, None, bandwidth, mode)
            if shape not in spec_shapes:
                continue
            synthetic = {"num_speculative_tokens": K, "rejection_sample_method": "synthetic",
                         "synthetic_acceptance_length": ACCEPTANCE_LENGTH}
            mode = modes[0] if tp > 1 else ""
            if args.draft:
                spec = {"method": "draft_model", "model": draft_dir, **synthetic}
                run_config(rows, label + "+draft1b", model_dir, tp, args, spec, bandwidth,
                           mode)
            if args.eagle:
                head = random_checkpoints.eagle3_head(model_dir, args.workdir, "cuda")
                spec = {"method": "eagle3", "model": head, **synthetic}
                run_config(rows, label + "+eagle3", model_dir, tp, args, spec, bandwidth, mode)
    add_speedups(rows)
    print_table(rows)
    result = dict(device=f"{torch.cuda.device_count()} x {name}",
                  copy_bandwidth_gb_s=bandwidth / 1e9, rows=rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
