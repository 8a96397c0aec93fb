"""CPU decode of the bundled GGUF: verispec with the weights kept quantised vs llama.cpp, in one
run.

The bundled SmolLM2-135M-Instruct Q4_1 GGUF, batch 1, greedy, up to ``--tokens`` new tokens per
chat prompt (EOS ends a request), ``--threads`` threads for everyone. Per prompt set (grounded:
the output copies the input; free: stories and questions), tokens/s (generated tokens over the
whole call, prefill included, summed over the set) of:

- ``llamacpp_plain`` / ``llamacpp_lookup``: llama.cpp through llama-cpp-python (only if it is
  installed: it is not a dependency), plain and with its prompt lookup decoding;
- ``ours_plain`` / ``ours_ngram``: verispec's engine on the quantised weights (the default);
- ``ours_eagle3``: with an EAGLE-3 head (``--eagle-head DIR``);
- ``ours_bf16_plain``: the engine on the same weights dequantised to bfloat16
  (``--dtype bfloat16``), for the quantised vs dequantised ratio.

Systems alternate per prompt, ``--repeats`` times, the fastest run of each counting (the least
disturbed on a shared machine). Then the time to first token of a ``--long-prompt-tokens``
prompt (verispec quantised; HF transformers' bfloat16 forward over the same weights; llama.cpp
if installed), and memory, each in a fresh process after the long prompt and 128 new tokens:
the resident memory one quantised engine adds to its process's imports (weights, tokenizer, KV
pool, scratch) at the speed runs' settings, and the peak of a whole process at ``verispec
generate``'s defaults, each against the GGUF file plus its KV pool.
Prints a table, then one JSON line.

    python benchmarks/bench_cpu_llamacpp.py
    python benchmarks/bench_cpu_llamacpp.py --num-prompts 2 --tokens 64 --repeats 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from functools import partial

import torch

from verispec import LLM, SamplingParams
from verispec.bench.prompts import FREE_PROMPTS, GROUNDED_PROMPTS
from verispec.bench.report import machine_description, print_table
from verispec.models.gguf import bundled_gguf_path
from verispec.ops.quant import QuantizedWeight


def run_ours(llm: LLM, chat, tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    out = llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=tokens))[0]
    return len(out.token_ids), time.perf_counter() - start


def run_llamacpp(model, chat, tokens: int) -> tuple[int, float]:
    model.reset()
    start = time.perf_counter()
    out = model.create_chat_completion(chat, max_tokens=tokens, temperature=0.0, top_k=1)
    return out["usage"]["completion_tokens"], time.perf_counter() - start


def load_llamacpp(path: str, threads: int, lookup: int | None):
    from llama_cpp import Llama

    kwargs = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    return Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                 verbose=False, **kwargs)


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    """About ``num_tokens`` token ids of chat: grounded prompts concatenated."""
    text, ids = "", []
    while len(ids) < num_tokens:
        text += "\n\n".join(GROUNDED_PROMPTS) + "\n\n"
        ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[:num_tokens]


def time_to_first_token(args, plain: LLM, llamacpp) -> dict:
    # each repeat its own prompt (a window one token further on), so no repeat is served from
    # the prefix cache of the one before
    all_ids = long_prompt(plain.tokenizer, args.long_prompt_tokens + args.repeats)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[str, list[float]] = {"ours_ttft_s": [], "hf_bf16_forward_s": []}
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from verispec.models.loader import resolve_model_path

        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(None),
                                                  dtype=torch.bfloat16).eval()
    if llamacpp is not None:
        times["llamacpp_ttft_s"] = []
    for repeat in range(args.repeats):
        ids = all_ids[repeat:repeat + args.long_prompt_tokens]
        start = time.perf_counter()
        plain.generate(ids, one)
        times["ours_ttft_s"].append(time.perf_counter() - start)
        if hf is not None:
            with torch.inference_mode():
                start = time.perf_counter()
                hf(torch.tensor([ids]))
                times["hf_bf16_forward_s"].append(time.perf_counter() - start)
        if llamacpp is not None:
            llamacpp.reset()
            start = time.perf_counter()
            llamacpp.create_completion(ids, max_tokens=1, temperature=0.0)
            times["llamacpp_ttft_s"].append(time.perf_counter() - start)
    row = {"prompt_tokens": args.long_prompt_tokens,
           **{k: min(v) for k, v in times.items() if v}}
    if hf is not None:
        row["ttft_vs_hf_bf16"] = row["ours_ttft_s"] / row["hf_bf16_forward_s"]
    return row


def status_mb(key: str) -> float:
    """This process's ``key`` line of /proc/self/status (VmRSS: resident now, VmHWM: peak),
    MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_child(args) -> None:
    """Run in a fresh process (``--memory-child``): what ``verispec generate`` holds. Imports
    as the CLI does, builds one engine (``max_model_len`` 2048, one request, as the speed runs;
    then ``verispec generate``'s own defaults), runs the ``--long-prompt-tokens`` prompt and 128
    new tokens through it (the KV pool's pages are written as they fill), and prints one JSON
    line: resident memory after the imports, the process's peak, the packed weights and the
    KV pool."""
    import transformers  # noqa: F401  (the tokenizer's: part of every engine's process)

    from verispec.models.loader import resolve_model_path  # noqa: F401

    imports = status_mb("VmRSS")
    kwargs = {} if args.memory_child == "generate" else {"max_model_len": 2048,
                                                          "max_num_seqs": 1}
    llm = LLM(**kwargs)
    ids = long_prompt(llm.tokenizer, args.long_prompt_tokens)
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    model = llm.runner.model
    packed = sum(b.numel() * b.element_size() for m in model.modules()
                 if isinstance(m, QuantizedWeight) for b in m.buffers())
    cache = llm.runner.kv_cache
    kv = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))
    print(json.dumps({"imports_mb": imports, "peak_mb": status_mb("VmHWM"),
                      "packed_weights_mb": packed / 2**20, "kv_pool_mb": kv / 2**20}))


def memory_row(args, gguf_path: str) -> dict:
    """Resident memory of one quantised engine (a fresh process each, ``memory_child``): what
    it adds to its process's imports at the speed runs' settings, and the whole process of
    ``verispec generate``'s defaults, each against the GGUF file plus the KV pool."""
    file_mb = os.path.getsize(gguf_path) / 2**20
    row = {"gguf_file_mb": file_mb}
    for kind in ("engine", "generate"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", kind,
                              "--long-prompt-tokens", str(args.long_prompt_tokens)],
                             check=True, capture_output=True, text=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        if kind == "engine":
            engine = m["peak_mb"] - m["imports_mb"]
            row.update(packed_weights_mb=m["packed_weights_mb"], kv_pool_mb=m["kv_pool_mb"],
                       engine_rss_mb=engine,
                       engine_rss_vs_file_plus_kv=engine / (file_mb + m["kv_pool_mb"]))
        else:
            row.update(generate_kv_pool_mb=m["kv_pool_mb"], generate_peak_rss_mb=m["peak_mb"],
                       generate_peak_vs_file_plus_kv=m["peak_mb"] / (file_mb + m["kv_pool_mb"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=5, help="n-gram and EAGLE-3 draft length")
    parser.add_argument("--lookup-tokens", type=int, default=10,
                        help="llama.cpp prompt lookup: tokens drafted")
    parser.add_argument("--eagle-head", default=None, help="an EAGLE-3 head's directory")
    parser.add_argument("--long-prompt-tokens", type=int, default=1750)
    parser.add_argument("--skip-hf", action="store_true", help="no HF bfloat16 prefill baseline")
    parser.add_argument("--skip-bf16", action="store_true", help="no bfloat16 verispec engine")
    parser.add_argument("--memory-child", choices=("engine", "generate"), default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args)
    gguf_path = bundled_gguf_path()
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    # no prefix caching: a repeat of a prompt prefills it again, as llama.cpp's (reset) does
    engine = {"max_model_len": 2048, "max_num_seqs": 1, "enable_prefix_caching": False}
    plain = LLM(**engine)
    runners = {"ours_plain": partial(run_ours, plain, tokens=args.tokens),
               "ours_ngram": partial(run_ours, LLM(**engine, speculative_config=ngram),
                                     tokens=args.tokens)}
    if args.eagle_head:
        eagle = LLM(**engine, speculative_config={
            "method": "eagle3", "model": args.eagle_head, "num_speculative_tokens": args.k})
        runners["ours_eagle3"] = partial(run_ours, eagle, tokens=args.tokens)
    if not args.skip_bf16:
        runners["ours_bf16_plain"] = partial(
            run_ours, LLM(dtype="bfloat16", **engine),
            tokens=args.tokens)
    llamacpp = None
    if importlib.util.find_spec("llama_cpp") is not None:
        llamacpp = load_llamacpp(gguf_path, args.threads, None)
        runners["llamacpp_plain"] = partial(run_llamacpp, llamacpp, tokens=args.tokens)
        runners["llamacpp_lookup"] = partial(
            run_llamacpp, load_llamacpp(gguf_path, args.threads, args.lookup_tokens),
            tokens=args.tokens)
    warm = [{"role": "user", "content": "Hello"}]
    for run in runners.values():
        run(warm)
    rows = []
    for set_name, prompts in (("grounded", GROUNDED_PROMPTS), ("free", FREE_PROMPTS)):
        totals = {name: [0, 0.0] for name in runners}
        for prompt in prompts[: args.num_prompts]:
            chat = [{"role": "user", "content": prompt}]
            best: dict[str, tuple[int, float]] = {}
            for _ in range(args.repeats):
                for name, run in runners.items():
                    n, seconds = run(chat)
                    if name not in best or seconds < best[name][1]:
                        best[name] = (n, seconds)
            for name, (n, seconds) in best.items():
                totals[name][0] += n
                totals[name][1] += seconds
        tps = {f"{name}_tok_s": n / s for name, (n, s) in totals.items()}
        row = {"prompts": set_name, **tps}
        base = tps.get("llamacpp_plain_tok_s")
        for name in runners:
            if base and name != "llamacpp_plain":
                row[f"{name}_vs_llamacpp_plain"] = tps[f"{name}_tok_s"] / base
        if "ours_bf16_plain_tok_s" in tps:
            row["quant_vs_bf16_plain"] = tps["ours_plain_tok_s"] / tps["ours_bf16_plain_tok_s"]
        row["ngram_vs_plain"] = tps["ours_ngram_tok_s"] / tps["ours_plain_tok_s"]
        rows.append(row)
        print_table(rows[-1:])
    ttft = time_to_first_token(args, plain, llamacpp)
    memory = memory_row(args, gguf_path)
    print(f"\nmachine: {machine_description()}; {args.threads} threads, batch 1, greedy, up to "
          f"{args.tokens} tokens, {args.num_prompts} prompts per set, best of {args.repeats}; "
          f"n-gram k={args.k}; llama.cpp: "
          f"{'installed' if llamacpp is not None else 'not installed (skipped)'}")
    print_table(rows)
    print_table([ttft])
    print_table([memory])
    print(json.dumps({"bench": "cpu_llamacpp", "machine": machine_description(),
                      "threads": args.threads, "rows": rows, "ttft": ttft, "memory": memory}))


if __name__ == "__main__":
    main()
