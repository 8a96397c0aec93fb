"""End to end on one GPU: verispec against the weight-bandwidth roofline and against HF
transformers, on a random-weight Llama-3.1-8B-shaped target with a Llama-3.2-1B-shaped draft.

The script writes both checkpoints itself (random normal weights, std 0.02, norms 1, bfloat16
safetensors, no tokenizer: prompts are random token ids), into ``--workdir`` (reused when it
already holds them) or a temporary directory. Then, all greedy with ``ignore_eos``:

- roofline: weight bytes of the target (tied embeddings once) / the measured device-to-device
  copy bandwidth (bytes read + written) = seconds per weight pass; batch B at most B / that
  tokens/s;
- batch 1, 32 prompt tokens, 256 output tokens: plain decoding, and draft-model speculation
  (k = 3, synthetic acceptance, mean acceptance length 2.5). Per run: output tokens/s over the
  whole ``generate``, decode tokens/s (after the first token), mean time to first token, decode
  tokens/s as a share of the roofline, mean acceptance length and speedup over plain decoding.
  The Leviathan et al. prediction from the engine's own counters: with a plain decode step of
  ``t`` seconds (plain decode time / decode steps) and per speculative step ``p`` seconds
  proposing and ``v`` verifying, predicted speedup = mean acceptance length / (p / t + v / t);
- batch 64 (64 prompts of 32 tokens, 128 output tokens each): the same two engines;
- an EAGLE-3 head for the target (one decoder layer of its shape, fc over layers 2 / 16 / 29, a
  32 000-token draft vocabulary; random weights as above) with the same synthetic acceptance at
  batch 1 and 64, and the device time of its captured k-step draft against a decode step;
- determinism (greedy): one request twice, alone against inside a batch of 8 other prompts, and
  CUDA graphs against eager; on a difference, the first differing index;
- peak GPU memory per engine, CUDA-graph capture time and memory, kernels per decode step seen
  by the torch profiler (17-token generate minus a 1-token one, over 16 decode steps), with
  graphs and with ``enforce_eager=True``;
- the batch-1 and batch-64 plain runs again with ``enforce_eager=True`` (graphs / eager);
- HF transformers on the same target: ``generate`` with its default cache, then with the
  static cache, with which ``generate`` compiles the decoding forward itself (``torch.compile``,
  fullgraph, CUDA graphs; warmed up twice); ours / theirs.

Times are whole ``generate`` calls (``torch.cuda.synchronize`` + ``perf_counter``) after a short
warm-up ``generate`` on each engine. Prints tables (the goals with their measured values among
them), then one JSON line.

    python benchmarks/bench_gpu_e2e.py                                  # on the GPU machine
    python benchmarks/bench_gpu_e2e.py --workdir /tmp/e2e --quick       # shorter runs
    python benchmarks/bench_gpu_e2e.py --tiny --device cpu --quick --skip-hf   # smoke run
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import struct
import sys
import tempfile
import time
import traceback

import torch
import transformers

from verispec import LLM, SamplingParams
from verispec.bench.report import machine_description, print_table

PROMPT_LEN = 32
BATCH = 64
K = 3
TENSOR_PARALLEL_SIZE = 1  # GPUs per engine (--tensor-parallel-size)
ACCEPTANCE_LENGTH = 2.5
MAX_MODEL_LEN = 512
GOALS = {  # name -> minimum
    "b1 draft measured / predicted": 0.9,
    "b1 draft / plain": 1.5,
    f"b{BATCH} draft / plain": 1.2,
    "b1 ours / hf static+compile": 1.6,
}
MAX_GOALS = {  # name -> maximum
    "b1 eagle: one draft forward / decode step": 0.1,
}
DRAFT_VOCAB = 32000  # the EAGLE-3 heads published for Llama-3.1-8B
ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)


# ----------------------------------------------------------------- checkpoints


def model_configs(tiny: bool) -> dict[str, dict]:
    """LlamaConfig keyword arguments of the target and the draft."""
    # No EOS token: HF's min_new_tokens would mask it and so part its greedy output from ours
    # wherever a random model picks it (our runs ignore EOS).
    common = dict(max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                  rope_scaling=dict(ROPE), bos_token_id=None, eos_token_id=None)
    if tiny:
        target = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                      tie_word_embeddings=False)
        draft = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=64, vocab_size=512,
                     tie_word_embeddings=True)
    else:  # Llama-3.1-8B and Llama-3.2-1B
        target = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      tie_word_embeddings=False)
        draft = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                     tie_word_embeddings=True)
    return {"target": {**common, **target}, "draft": {**common, **draft}}


def has_checkpoint(path: str, kwargs: dict) -> bool:
    """``path`` holds a checkpoint of this shape (so a ``--workdir`` is reused)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path) or not any(
            f.endswith(".safetensors") for f in os.listdir(path)):
        return False
    with open(config_path) as f:
        saved = json.load(f)
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
            "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    return all(saved.get(key) == kwargs[key] for key in keys)


@torch.no_grad()
def build_checkpoint(kwargs: dict, path: str, device: torch.device, seed: int) -> None:
    """Random weights (normal, std 0.02; norm weights 1) made on ``device`` in bfloat16, saved
    as safetensors with ``save_pretrained`` (no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**kwargs))
    finally:
        torch.set_default_dtype(previous)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(path)
    del model
    free_memory(device)


def checkpoints(workdir: str, tiny: bool, device: torch.device) -> dict[str, str]:
    """{"target": dir, "draft": dir}, built unless ``workdir`` already holds them."""
    dirs = {}
    for seed, (role, kwargs) in enumerate(model_configs(tiny).items()):
        path = os.path.join(workdir, role)
        os.makedirs(path, exist_ok=True)
        if has_checkpoint(path, kwargs):
            print(f"{role}: reusing {path}")
        else:
            start = time.perf_counter()
            build_checkpoint(kwargs, path, device, seed)
            print(f"{role}: wrote {path} in {time.perf_counter() - start:.1f} s")
        dirs[role] = path
    return dirs


@torch.no_grad()
def build_eagle_head(target: dict, path: str, device: torch.device, seed: int,
                     draft_vocab_size: int) -> None:
    """A random EAGLE-3 head for ``target`` (LlamaConfig kwargs) in the published layout
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``; no embedding: the
    target's): bfloat16 normal std 0.02, norms 1, a random draft vocabulary."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(seed)
    H, inter, V = target["hidden_size"], target["intermediate_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, L = H // heads, target["num_hidden_layers"]

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)

    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size]
    ids = ids.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    ones = torch.ones(H, dtype=torch.bfloat16)
    state = {
        "fc.weight": rand(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, H),
        "midlayer.mlp.up_proj.weight": rand(inter, H),
        "midlayer.mlp.down_proj.weight": rand(H, inter),
        "midlayer.input_layernorm.weight": ones, "midlayer.hidden_norm.weight": ones,
        "midlayer.post_attention_layernorm.weight": ones, "norm.weight": ones,
        "lm_head.weight": rand(draft_vocab_size, H),
        "d2t": ids - torch.arange(draft_vocab_size), "t2d": t2d,
    }
    config = {key: target[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False,
                  draft_vocab_size=draft_vocab_size, target_hidden_size=H,
                  eagle_config={"eagle_aux_hidden_state_layer_ids":
                                [2, L // 2, L - 3] if L >= 6 else [0, L // 2, L - 1]})
    os.makedirs(path, exist_ok=True)
    save_file({k: v.cpu().contiguous().clone() for k, v in state.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def eagle_head(workdir: str, tiny: bool, device: torch.device) -> str:
    """The EAGLE-3 head's directory (built unless ``workdir`` has it)."""
    target = model_configs(tiny)["target"]
    draft_vocab = min(DRAFT_VOCAB, target["vocab_size"] // 2)
    path = os.path.join(workdir, "eagle3")
    config_path = os.path.join(path, "config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            saved = json.load(f)
        if (saved.get("hidden_size"), saved.get("draft_vocab_size")) == (
                target["hidden_size"], draft_vocab):
            print(f"eagle3: reusing {path}")
            return path
    start = time.perf_counter()
    build_eagle_head(target, path, device, 7, draft_vocab)
    print(f"eagle3: wrote {path} in {time.perf_counter() - start:.1f} s")
    return path


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's tensors, from the safetensors headers (a tied lm_head once)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    total = 0
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key == "__metadata__" or (tied and key == "lm_head.weight"):
                continue
            begin, end = info["data_offsets"]
            total += end - begin
    return total


# ----------------------------------------------------------------- device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a device-to-device copy (median of several): 1 GiB
    timed with CUDA events on a GPU, 64 MiB with ``perf_counter`` on the CPU."""
    num_bytes = 2**30 if device.type == "cuda" else 2**26
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    free_memory(device)
    return 2 * num_bytes / statistics.median(times)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


# ----------------------------------------------------------------- engine runs


def random_prompts(num: int, vocab_size: int, seed: int, length: int = PROMPT_LEN,
                   max_length: int | None = None) -> list[list[int]]:
    """Token-id prompts of ``length`` tokens (or lengths drawn in [length, max_length])."""
    gen = torch.Generator().manual_seed(seed)
    lengths = ([length] * num if max_length is None
               else torch.randint(length, max_length + 1, (num,), generator=gen).tolist())
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(model_dir: str, device: torch.device, eager: bool, draft_dir: str | None = None,
             method: str = "draft_model"):
    """An engine (peak memory reset first) and its start-up seconds (load + graph capture);
    ``method`` "eagle3" with the head's directory as ``draft_dir``."""
    spec = None if draft_dir is None else {
        "method": method, "model": draft_dir, "num_speculative_tokens": K,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": ACCEPTANCE_LENGTH}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    llm = LLM(model_dir, device=device, dtype="bfloat16", max_num_seqs=BATCH,
              max_model_len=MAX_MODEL_LEN, enforce_eager=eager, speculative_config=spec,
              tensor_parallel_size=TENSOR_PARALLEL_SIZE)
    return llm, time.perf_counter() - start


def spec_counters(llm) -> tuple[float, float, int, int, int]:
    """(propose s, verify s, speculative steps, drafts, accepted tokens) so far."""
    spec = llm.spec
    if spec is None:
        return 0.0, 0.0, 0, 0, 0
    stats = spec.stats
    return (spec.propose_time_s, spec.verify_time_s, spec.num_steps,
            getattr(stats, "num_drafts", 0), getattr(stats, "num_accepted_tokens", 0))


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, device: torch.device,
                   label: str) -> tuple[dict, list[list[int]]]:
    """One timed ``generate`` of ``prompts``: the row of the runs table (and its counters), and
    the output token ids."""
    before, steps_before = spec_counters(llm), llm.num_steps
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(max_tokens))
    sync(device)
    seconds = time.perf_counter() - start
    after = spec_counters(llm)
    ttfts = [o.metrics.time_to_first_token_s for o in outputs]
    num_tokens = sum(len(o.token_ids) for o in outputs)
    decode_s = seconds - max(ttfts)  # every request has its first token by then
    row = dict(run=label, B=len(prompts), eager=llm.enforce_eager, tokens=num_tokens,
               seconds=seconds, out_tok_s=num_tokens / seconds,
               decode_tok_s=(num_tokens - len(prompts)) / decode_s,
               ttft_ms=1e3 * statistics.mean(ttfts),
               # one prefill step for the whole batch (B <= max_num_seqs)
               decode_steps=llm.num_steps - steps_before - 1, decode_s=decode_s)
    if llm.spec is not None:
        propose_s, verify_s, steps, drafts, accepted = (a - b for a, b in zip(after, before))
        row.update(spec_steps=steps, propose_s=propose_s, verify_s=verify_s,
                   accept_len=1.0 + accepted / drafts if drafts
                   else llm.spec.stats.mean_acceptance_length)
    return row, [o.token_ids for o in outputs]


def warm_up(llm, prompts: list[list[int]]) -> None:
    llm.generate(prompts, greedy(8))


def add_roofline(row: dict, step_s: float) -> None:
    """Decode tokens/s as a share of B tokens per weight pass."""
    row["roofline_tok_s"] = row["B"] / step_s
    row["roofline_pct"] = 100 * row["decode_tok_s"] / row["roofline_tok_s"]


def add_speedup(spec_row: dict, plain_row: dict) -> None:
    """Speedup over the plain run of the same batch, and the Leviathan prediction from the
    engine's counters: L / (p / t + v / t), t = plain seconds per decode step."""
    plain_step_s = plain_row["decode_s"] / max(plain_row["decode_steps"], 1)
    steps = max(spec_row["spec_steps"], 1)
    propose = spec_row["propose_s"] / steps / plain_step_s
    verify = spec_row["verify_s"] / steps / plain_step_s
    spec_row.update(
        speedup=spec_row["decode_tok_s"] / plain_row["decode_tok_s"],
        speedup_out=spec_row["out_tok_s"] / plain_row["out_tok_s"],
        plain_step_ms=1e3 * plain_step_s, propose_cost=propose, verify_cost=verify,
        predicted=spec_row["accept_len"] / (propose + verify))
    spec_row["measured_x_predicted"] = spec_row["speedup"] / spec_row["predicted"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix); None if
    equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(name: str, a: list[int], b: list[int]) -> dict:
    diff = first_difference(a, b)
    return dict(check=name, identical=diff is None, first_diff=diff, tokens=len(a))


def determinism(llm, vocab_size: int, max_tokens: int) -> tuple[list[dict], list[int]]:
    """Greedy: one request twice; alone and at position 4 of a batch with 8 other prompts of
    16-48 tokens. Returns the checks and the request's tokens."""
    prompt = random_prompts(1, vocab_size, seed=1234)[0]
    others = random_prompts(8, vocab_size, seed=4321, length=16, max_length=48)
    first = llm.generate([prompt], greedy(max_tokens))[0].token_ids
    second = llm.generate([prompt], greedy(max_tokens))[0].token_ids
    batch = llm.generate(others[:4] + [prompt] + others[4:], greedy(max_tokens))
    return [check("repeat", first, second),
            check("alone_vs_batch", first, batch[4].token_ids)], first


def count_kernels(llm, prompt: list[int], device: torch.device) -> dict:
    """``profile_kernels``, the error in the row instead of a crash."""
    try:
        return profile_kernels(llm, prompt, device)
    except Exception as exc:  # the timed results must still print
        traceback.print_exc(file=sys.stderr)
        return dict(eager=llm.enforce_eager, error=f"{type(exc).__name__}: {exc}"[:300])


def profile_kernels(llm, prompt: list[int], device: torch.device) -> dict:
    """Profiler events of a 17-token generate (1 prefill + 16 decode steps) and of a 1-token
    one: CUDA kernels (device events other than memcpy/memset) per decode step, net of the
    prefill ((17-token - 1-token) / 16) and raw (17-token / 16), and host launch calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    counts = {}
    for max_tokens in (1, 17):
        with profile(activities=activities) as prof:
            llm.generate([prompt], greedy(max_tokens))
            sync(device)
        events = prof.events()
        device_events = [e.name for e in events if e.device_type == DeviceType.CUDA]
        counts[max_tokens] = dict(
            kernels=sum(not n.startswith(("Memcpy", "Memset")) for n in device_events),
            copies=sum(n.startswith(("Memcpy", "Memset")) for n in device_events),
            kernel_launches=sum("LaunchKernel" in e.name for e in events),
            graph_launches=sum("GraphLaunch" in e.name for e in events))
    net = {f"{key}_per_step": (counts[17][key] - counts[1][key]) / 16 for key in counts[17]}
    return dict(eager=llm.enforce_eager, **net,
                kernels_per_step_raw=counts[17]["kernels"] / 16)


def graph_info(llm) -> dict:
    """Capture seconds and memory of the target's graphs (and the draft's), None if absent."""
    info = {}
    owners = {"target": getattr(llm, "runner", None)}
    proposer = getattr(getattr(llm, "spec", None), "proposer", None)
    if proposer is not None:
        owners["draft"] = getattr(proposer, "runner", None)
    for role, owner in owners.items():
        graphs = getattr(owner, "graphs", None)
        info[f"{role}_capture_s"] = getattr(graphs, "capture_time_s", None)
        info[f"{role}_graph_mib"] = (None if getattr(graphs, "memory_bytes", None) is None
                                     else graphs.memory_bytes / 2**20)
    return info


def graph_costs(llm, batch_sizes, label: str) -> list[dict]:
    """Device milliseconds of one replay of the target's decode and verify graphs and of the
    proposer's draft graph (k forwards) per batch size (empty without graphs)."""
    runner, proposer = llm.runner, llm.spec.proposer
    graphs, draft_graphs = runner.graphs, proposer.runner.graphs
    if graphs is None or not graphs.capture_graphs or not draft_graphs.has(proposer.graph_name):
        return []
    rows = []
    for b in batch_sizes:
        decode = graphs.time_step(runner.graph_name(1), b)
        draft = draft_graphs.time_step(proposer.graph_name, b)
        rows.append(dict(proposer=label, B=b, decode_graph_ms=1e3 * decode,
                         verify_graph_ms=1e3 * graphs.time_step(runner.graph_name(K + 1), b),
                         draft_graph_ms=1e3 * draft, draft_x_decode=draft / decode,
                         draft_forward_x_decode=draft / K / decode))
    return rows


def step_rows(runs: dict, costs: list[dict]) -> list[dict]:
    """Where a speculative step goes: its wall time against the graphs it replays; the rest is
    the host's work between graphs (and the rejection sampler)."""
    rows = []
    for cost in costs:
        spec = runs[f"b{cost['B']} {cost['proposer']}"]
        plain = runs[f"b{cost['B']} plain"]
        step_ms = 1e3 * spec["decode_s"] / max(spec["spec_steps"], 1)
        plain_ms = 1e3 * plain["decode_s"] / max(plain["decode_steps"], 1)
        rows.append(dict(cost, plain_step_ms=plain_ms,
                         plain_rest_ms=plain_ms - cost["decode_graph_ms"], spec_step_ms=step_ms,
                         spec_rest_ms=step_ms - cost["verify_graph_ms"] - cost["draft_graph_ms"]))
    return rows


def engine_summary(name: str, llm, startup_s: float, device: torch.device) -> dict:
    peak = peak_memory(device)
    return dict(engine=name, startup_s=startup_s,
                peak_gib=None if peak is None else peak / 2**30, **graph_info(llm))


def run_engines(dirs: dict, device: torch.device, lengths: dict, vocab_size: int) -> dict:
    """Every verispec run, one engine at a time: graphs plain, graphs + draft, graphs + EAGLE-3
    head, eager plain."""
    prompt = random_prompts(1, vocab_size, seed=0)[0]
    batch = random_prompts(BATCH, vocab_size, seed=1)
    runs, engines, kernels, token_ids = {}, [], [], {}

    def timed(llm, label: str) -> None:
        prompts, num = ([prompt], lengths["b1"]) if label.startswith("b1 ") else (
            batch, lengths["batch"])
        runs[label], token_ids[label] = timed_generate(llm, prompts, num, device, label)

    def plain_runs(llm, suffix: str) -> None:
        warm_up(llm, [prompt])
        warm_up(llm, batch)
        timed(llm, "b1 plain" + suffix)
        timed(llm, f"b{BATCH} plain" + suffix)
        kernels.append(count_kernels(llm, prompt, device))

    llm, startup = make_llm(dirs["target"], device, eager=False)
    plain_runs(llm, "")
    checks, graph_tokens = determinism(llm, vocab_size, lengths["determinism"])
    engines.append(engine_summary("plain", llm, startup, device))
    llm.close()
    del llm
    free_memory(device)

    llm, startup = make_llm(dirs["target"], device, eager=False, draft_dir=dirs["draft"])
    warm_up(llm, [prompt])
    warm_up(llm, batch)
    timed(llm, "b1 draft")
    timed(llm, f"b{BATCH} draft")
    costs = graph_costs(llm, (1, BATCH), "draft")
    engines.append(engine_summary("draft", llm, startup, device))
    llm.close()
    del llm
    free_memory(device)

    llm, startup = make_llm(dirs["target"], device, eager=False, draft_dir=dirs["eagle3"],
                            method="eagle3")
    warm_up(llm, [prompt])
    warm_up(llm, batch)
    timed(llm, "b1 eagle")
    timed(llm, f"b{BATCH} eagle")
    costs += graph_costs(llm, (1, BATCH), "eagle")
    engines.append(engine_summary("eagle", llm, startup, device))
    llm.close()
    del llm
    free_memory(device)

    llm, startup = make_llm(dirs["target"], device, eager=True)
    plain_runs(llm, " eager")
    _, eager_tokens = determinism(llm, vocab_size, lengths["determinism"])
    checks.append(check("graphs_vs_eager", graph_tokens, eager_tokens))
    engines.append(engine_summary("plain eager", llm, startup, device))
    llm.close()
    del llm
    free_memory(device)
    return dict(runs=runs, engines=engines, kernels=kernels, determinism=checks,
                graph_costs=costs, prompt=prompt, b1_token_ids=token_ids["b1 plain"][0])


# ----------------------------------------------------------------- HF transformers


def load_hf(model_dir: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    except TypeError:  # transformers 4 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    return model.to(device).eval()


def hf_run(name: str, generate, prompt_len: int, device: torch.device, warm_ups=()) -> dict:
    """The warm-up calls, then one timed ``generate()``; the error in the row, not a crash."""
    try:
        for warm_up_call in warm_ups:
            warm_up_call()
        sync(device)
        start = time.perf_counter()
        out = generate()
        sync(device)
        seconds = time.perf_counter() - start
    except Exception as exc:  # the engine's results must still print
        traceback.print_exc(file=sys.stderr)
        return dict(run=name, error=f"{type(exc).__name__}: {exc}"[:300])
    token_ids = out[0, prompt_len:].tolist()
    return dict(run=name, tokens=len(token_ids), seconds=seconds,
                out_tok_s=len(token_ids) / seconds, token_ids=token_ids)


def hf_baselines(model_dir: str, prompt: list[int], max_new: int, device: torch.device) -> list:
    """Batch 1, greedy, exactly ``max_new`` tokens: the default cache, then the static cache with
    the forward compiled (reduce-overhead: CUDA graphs)."""
    try:
        model = load_hf(model_dir, device)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return [dict(run="hf load", error=f"{type(exc).__name__}: {exc}"[:300])]
    input_ids = torch.tensor([prompt], device=device)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                  min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    short = dict(kwargs, max_new_tokens=8, min_new_tokens=8)
    rows = [hf_run("hf default cache", functools.partial(model.generate, input_ids, **kwargs),
                   len(prompt), device, [functools.partial(model.generate, input_ids, **short)])]
    # With the static cache, generate compiles the decoding forward itself (its CompileConfig:
    # fullgraph, mode "reduce-overhead", so CUDA graphs); warmed up twice at the same lengths.
    static = functools.partial(model.generate, input_ids, cache_implementation="static",
                               **kwargs)
    rows.append(hf_run("hf static+compile", static, len(prompt), device, [static, static]))
    del model
    torch._dynamo.reset()
    free_memory(device)
    return rows


# ----------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def goal_rows(runs: dict, hf: list, checks: list, costs: list[dict]) -> list[dict]:
    hf_static = next((r.get("out_tok_s") for r in hf if r["run"] == "hf static+compile"), None)
    values = {
        "b1 draft measured / predicted": runs["b1 draft"]["measured_x_predicted"],
        "b1 draft / plain": runs["b1 draft"]["speedup"],
        f"b{BATCH} draft / plain": runs[f"b{BATCH} draft"]["speedup"],
        "b1 ours / hf static+compile": ratio(runs["b1 plain"]["out_tok_s"], hf_static),
    }
    rows = [dict(goal=name, value=value, minimum=GOALS[name],
                 met=None if value is None else value >= GOALS[name])
            for name, value in values.items()]
    eagle = next((c for c in costs if c["proposer"] == "eagle" and c["B"] == 1), None)
    for name, maximum in MAX_GOALS.items():
        value = None if eagle is None else eagle["draft_forward_x_decode"]
        rows.append(dict(goal=name, value=value, maximum=maximum,
                         met=None if value is None else value <= maximum))
    rows += [dict(goal=f"determinism: {c['check']}", value=c["first_diff"], minimum=None,
                  met=c["identical"]) for c in checks]
    return rows


def eager_rows(runs: dict) -> list[dict]:
    rows = []
    for name in ("b1 plain", f"b{BATCH} plain"):
        graphs, eager = runs[name], runs[name + " eager"]
        rows.append(dict(run=name, graphs_tok_s=graphs["decode_tok_s"],
                         eager_tok_s=eager["decode_tok_s"],
                         graphs_x_eager=graphs["decode_tok_s"] / eager["decode_tok_s"],
                         graphs_ttft_ms=graphs["ttft_ms"], eager_ttft_ms=eager["ttft_ms"]))
    return rows


def hf_ratio_rows(runs: dict, hf: list) -> list[dict]:
    """HF rows with ours / theirs (output tokens/s over the whole generate, batch 1)."""
    rows = []
    for row in hf:
        shown = {k: v for k, v in row.items() if k != "token_ids"}
        theirs = row.get("out_tok_s")
        shown["plain_x_hf"] = ratio(runs["b1 plain"]["out_tok_s"], theirs)
        shown["draft_x_hf"] = ratio(runs["b1 draft"]["out_tok_s"], theirs)
        rows.append(shown)
    return rows


def print_report(result: dict) -> None:
    runs = result["runs"]
    print_table(list(runs.values()),
                ["run", "B", "eager", "tokens", "seconds", "out_tok_s", "decode_tok_s",
                 "ttft_ms", "roofline_tok_s", "roofline_pct", "accept_len", "speedup",
                 "speedup_out", "predicted", "measured_x_predicted"])
    print()
    draft = [r for r in runs.values() if "predicted" in r]
    print("Leviathan prediction from the engine's counters (costs in plain decode steps):")
    print_table(draft, ["run", "plain_step_ms", "spec_steps", "propose_cost", "verify_cost",
                        "accept_len", "predicted", "speedup", "measured_x_predicted"], ".3f")
    print()
    if result["steps"]:
        print("where a step goes (ms; rest = wall - graphs: host work and the sampler):")
        print_table(result["steps"], float_format=".3f")
        print()
    print_table(result["eager"], float_format=".2f")
    print()
    print("per engine (peak GPU memory since its start; n/a: not on this device or not exposed):")
    print_table([{k: "n/a" if v is None else v for k, v in row.items()}
                 for row in result["engines"]], float_format=".2f")
    print()
    print("kernels per decode step (profiler; replays of CUDA graphs may hide their kernels):")
    print_table(result["kernels"], float_format=".1f")
    print()
    print_table(result["determinism"])
    if result["hf"]:
        print()
        print_table(hf_ratio_rows(runs, result["hf"]))
    print()
    print_table(result["goals"], float_format=".3f")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny target and draft (smoke runs) instead of 8B / 1B shapes")
    parser.add_argument("--quick", action="store_true", help="fewer output tokens per run")
    parser.add_argument("--skip-hf", action="store_true", help="no HF transformers baselines")
    parser.add_argument("--workdir", default=None,
                        help="where the checkpoints are written (reused if present); default a "
                             "temporary directory, removed at the end")
    parser.add_argument("--json-out", default=None, help="also write the JSON result here")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs per engine (the roofline is then one pass over a rank's "
                             "share of the weights; no HF baselines)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, workdir: str) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but CUDA is not available here (use --device cpu)")
    lengths = (dict(b1=64, batch=32, determinism=32, hf=64) if args.quick
               else dict(b1=256, batch=128, determinism=64, hf=256))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device)
    dirs = checkpoints(workdir, args.tiny, device)
    dirs["eagle3"] = eagle_head(workdir, args.tiny, device)
    vocab_size = model_configs(args.tiny)["target"]["vocab_size"]
    global TENSOR_PARALLEL_SIZE
    TENSOR_PARALLEL_SIZE = args.tensor_parallel_size
    target_bytes = weight_bytes(dirs["target"])
    step_s = target_bytes / args.tensor_parallel_size / bandwidth  # a rank's share
    print(machine_description())
    print(f"device: {name}; torch {torch.__version__}; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (read + write); target weights {target_bytes / 1e9:.2f} "
          f"GB -> {1e3 * step_s:.3f} ms per weight pass, roofline {1 / step_s:.1f} tok/s at "
          f"B = 1, {BATCH / step_s:.0f} tok/s at B = {BATCH}\n")

    engine = run_engines(dirs, device, lengths, vocab_size)
    runs = engine["runs"]
    for row in runs.values():
        add_roofline(row, step_s)
    for b in (1, BATCH):
        for proposer in ("draft", "eagle"):
            add_speedup(runs[f"b{b} {proposer}"], runs[f"b{b} plain"])
    hf = []
    if not (args.skip_hf or args.tensor_parallel_size > 1
            or (args.tiny and device.type == "cpu")):
        hf = hf_baselines(dirs["target"], engine["prompt"], lengths["hf"], device)
    for row in hf:
        if "token_ids" in row:  # bfloat16 kernels differ: where the greedy outputs part
            row["first_diff_vs_ours"] = first_difference(row.pop("token_ids"),
                                                         engine["b1_token_ids"])
    return dict(
        benchmark="bench_gpu_e2e", device=name, machine=machine_description(),
        torch=torch.__version__, transformers=transformers.__version__, tiny=args.tiny,
        quick=args.quick, copy_bandwidth_gb_s=bandwidth / 1e9, target_weight_bytes=target_bytes,
        draft_weight_bytes=weight_bytes(dirs["draft"]), roofline_step_ms=1e3 * step_s,
        roofline_tok_s_b1=1 / step_s, roofline_tok_s_batch=BATCH / step_s, batch=BATCH, k=K,
        synthetic_acceptance_length=ACCEPTANCE_LENGTH, lengths=lengths, runs=runs,
        eager=eager_rows(runs), steps=step_rows(runs, engine["graph_costs"]),
        engines=engine["engines"], kernels=engine["kernels"],
        determinism=engine["determinism"], hf=hf,
        goals=goal_rows(runs, hf, engine["determinism"], engine["graph_costs"]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.workdir is not None:
        os.makedirs(args.workdir, exist_ok=True)
        result = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_gpu_e2e_") as workdir:
            result = run(args, workdir)
    print_report(result)
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    main()
