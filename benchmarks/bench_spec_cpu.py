"""Speculative decoding on CPU: our n-gram vs our plain engine vs HF ``generate`` and HF prompt
lookup, in one run.

The bundled SmolLM2-135M-Instruct, batch 1, greedy, ``--tokens`` new tokens per prompt (EOS ends
a request, as a user would run it; both systems stop at the same EOS because greedy outputs are
equal in float32). Two prompt sets: input-grounded (code editing, summarising a given text; the
output copies the input) and free (stories, questions). Four systems per prompt, alternated so
they see the same machine load: our no-speculation engine, our n-gram (k and lookup range from
the flags), HF ``generate`` greedy, HF prompt lookup (``prompt_lookup_num_tokens``). tokens/s is
generated tokens over the whole call (prefill included), summed over the prompt set. Prints a
table, then one JSON line.

    python benchmarks/bench_spec_cpu.py                       # float32 + bfloat16
    python benchmarks/bench_spec_cpu.py --dtypes float32 --num-prompts 4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from verispec import LLM, SamplingParams
from verispec.bench.prompts import FREE_PROMPTS, GROUNDED_PROMPTS
from verispec.bench.report import machine_description, print_table
from verispec.engine.metrics import SpecDecodingStats

SYSTEMS = ("ours_plain", "ours_ngram", "hf_greedy", "hf_prompt_lookup")


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.models.loader import resolve_model_path

    path = resolve_model_path(None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


def run_ours(llm: LLM, chat, tokens: int) -> tuple[int, float, object]:
    start = time.perf_counter()
    out = llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=tokens))[0]
    return len(out.token_ids), time.perf_counter() - start, out.spec_stats


def run_hf(model, tokenizer, chat, tokens: int, eos: list[int], lookup: int | None):
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0], **kwargs)
    return out.shape[1] - ids.shape[1], time.perf_counter() - start, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--hf-lookup-tokens", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each system per prompt (alternated); the fastest counts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}
    sets = {"grounded": GROUNDED_PROMPTS[: args.num_prompts],
            "free": FREE_PROMPTS[: args.num_prompts]}
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        plain = LLM(dtype=dtype_name, max_model_len=2048, max_num_seqs=1)
        ngram = LLM(dtype=dtype_name, max_model_len=2048, max_num_seqs=1,
                    speculative_config=spec)
        hf, tokenizer = load_hf(dtype)
        eos = sorted(plain.eos_token_ids)
        runners = {
            "ours_plain": partial(run_ours, plain, tokens=args.tokens),
            "ours_ngram": partial(run_ours, ngram, tokens=args.tokens),
            "hf_greedy": partial(run_hf, hf, tokenizer, tokens=args.tokens, eos=eos,
                                 lookup=None),
            "hf_prompt_lookup": partial(run_hf, hf, tokenizer, tokens=args.tokens, eos=eos,
                                        lookup=args.hf_lookup_tokens),
        }
        warm = [{"role": "user", "content": "Hello"}]
        for run in runners.values():
            run(warm)
        for set_name, prompts in sets.items():
            totals = {name: [0, 0.0] for name in SYSTEMS}
            ngram_stats = None
            for prompt in prompts:
                chat = [{"role": "user", "content": prompt}]
                best = {}
                for _ in range(args.repeats):
                    for name in SYSTEMS:
                        n, seconds, spec_stats = runners[name](chat)
                        if name not in best or seconds < best[name][1]:
                            best[name] = (n, seconds)
                        if name == "ours_ngram" and spec_stats is not None:
                            if ngram_stats is None:
                                ngram_stats = SpecDecodingStats(args.k)
                            ngram_stats.merge(spec_stats)
                for name, (n, seconds) in best.items():
                    totals[name][0] += n
                    totals[name][1] += seconds
            tps = {name: n / s for name, (n, s) in totals.items()}
            rows.append({
                "dtype": dtype_name, "prompts": set_name,
                **{f"{name}_tok_s": tps[name] for name in SYSTEMS},
                "ngram_vs_plain": tps["ours_ngram"] / tps["ours_plain"],
                "ngram_vs_hf_lookup": tps["ours_ngram"] / tps["hf_prompt_lookup"],
                "plain_vs_hf": tps["ours_plain"] / tps["hf_greedy"],
                "hf_lookup_vs_hf": tps["hf_prompt_lookup"] / tps["hf_greedy"],
                "mean_acceptance_length": (ngram_stats.mean_acceptance_length
                                           if ngram_stats is not None else None),
            })
            print_table(rows[-1:])
    print(f"\nmachine: {machine_description()}; batch 1, greedy, up to {args.tokens} tokens, "
          f"{args.num_prompts} prompts per set, best of {args.repeats}, n-gram k={args.k} "
          f"lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
          f"HF prompt_lookup_num_tokens={args.hf_lookup_tokens}")
    print_table(rows)
    print(json.dumps({"bench": "spec_cpu", "machine": machine_description(), "rows": rows}))


if __name__ == "__main__":
    main()
