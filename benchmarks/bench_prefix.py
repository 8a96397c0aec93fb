"""Prefix caching and chunked prefill, offline: two scenarios on an in-process ``LLM`` whose step
loop the script drives itself (``add_request`` / ``step``), so that requests arrive when they
would and every time is real. Each scenario runs with the feature on and with it off, one engine
after the other in the same process; the ratios come from that one run.

1. Multi-turn chat (``enable_prefix_caching`` on / off). ``--num-conversations`` (64) of
   ``--num-turns`` (6) turns share a ``--system-len`` (2 000) token system prompt; each user turn
   is ``--user-len`` tokens (200, drawn in [0.75x, 1.25x]) and each answer ``--answer-len``
   (128; greedy, ``ignore_eos``), all seeded random token ids. Conversations start together (or
   at Poisson times, ``--conversation-rate``); turn t + 1 is submitted in the step loop as soon
   as turn t finishes, its prompt everything so far: system + user 1 + answer 1 + ... + user
   t + 1. Reported: time to first token (the engine's: ``add_request`` -> the step that
   committed the first token) p50 / p99 of turn 1 and of turns 2.., with caching over without
   (goal: turns 2.. p50 <= 0.2x); the prefix-cache hit rate = cached prompt tokens / prompt
   tokens (``RequestOutput.num_cached_tokens``), over all turns and over turns 2..; and the
   number of requests whose output differs with caching from without (greedy, a fixed seed per
   request: must be 0; under synthetic acceptance the output is whichever drafts pass, so there
   a difference means the proposer drafted differently, not that the target's tokens changed).
2. A long prompt arrives during decoding (``enable_chunked_prefill`` on / off).
   ``--num-streams`` (32) requests of ``--stream-prompt-len`` (64) tokens decode
   ``--stream-output-len`` (512) tokens each; once every stream has ``--long-after`` (32)
   tokens, one prompt of ``--long-prompt-len`` (32 768) tokens arrives. After every step the
   script notes the time and each stream's new tokens; a stream's inter-token latencies (ITL)
   are the gaps between the steps that gave it tokens, a gap that gave n tokens counting as n
   latencies of gap / n (speculation). Reported: the streams' median, p99 and worst ITL and
   worst / median (goal: <= 4x with chunked prefill), the worst stream's own worst / median, and
   the long prompt's time to first token. ``--max-num-batched-tokens`` (512; both engines) is
   the most tokens a step computes, the streams' decodes and a prefill chunk together, which
   sets the chunk size; without chunking the long prompt's prefill is a step of its own.
   ``--prefill-attention-budget`` also bounds the chunks by their attention (``LLM``'s
   ``prefill_attention_budget``), so they shrink as the long prompt's context grows.

Both scenarios run greedy, with speculation when ``--speculative-config`` says so (``ngram``,
``eagle3`` or a vLLM JSON object, as in ``bench_serving.py``). Each engine first runs a smaller
copy of its scenario with other tokens, untimed (kernels compiled on first use). The target is
``--model``, else a random-weight Llama-3.1-8B-shaped one (``--tiny``: a 2-layer one and every
size scaled down, for a CPU smoke run) written under ``--workdir``. Prints a table per scenario,
then one JSON line.

    python benchmarks/bench_prefix.py --device cuda --workdir /tmp/bench_models
    python benchmarks/bench_prefix.py --tiny --device cpu       # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoints import (  # noqa: E402
    config_label,
    model_config,
    speculative_config,
    target_checkpoint,
)

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench.report import machine_description, print_table  # noqa: E402

CHAT_GOAL = 0.2  # turns 2.. TTFT p50 with caching / without, at most
LONG_GOAL = 4.0  # streams' worst ITL / median ITL with chunked prefill, at most
SIZES = {  # flag -> (default, --tiny)
    "num_conversations": (64, 4), "num_turns": (6, 3), "system_len": (2000, 256),
    "user_len": (200, 32), "answer_len": (128, 16), "num_streams": (32, 4),
    "stream_prompt_len": (64, 16), "stream_output_len": (512, 96), "long_after": (32, 8),
    "long_prompt_len": (32768, 1024), "max_num_batched_tokens": (512, 64),
}


def greedy(max_tokens: int, seed: int) -> SamplingParams:
    """Greedy with a fixed seed: synthetic acceptance draws from the request's seed, so only a
    seed that is the same in both engines makes their outputs comparable."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1000) if len(values) else None


def make_llm(args: argparse.Namespace, max_model_len: int, max_num_seqs: int,
             **flags) -> LLM:
    """An engine of the run's model and speculation with ``flags`` (the feature toggled)."""
    gc.collect()  # the previous engine's memory back first
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, speculative_config=args.spec, **flags)


# ----------------------------------------------------------------- 1. multi-turn chat


def chat_workload(args: argparse.Namespace, vocab_size: int, seed: int,
                  num_conversations: int, num_turns: int) -> tuple[list[int], list[list[list]]]:
    """(system prompt ids, users[conversation][turn] ids), seeded."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, args.system_len).tolist()
    lo, hi = max(1, round(0.75 * args.user_len)), round(1.25 * args.user_len)
    users = [[rng.integers(0, vocab_size, rng.integers(lo, hi + 1)).tolist()
              for _ in range(num_turns)] for _ in range(num_conversations)]
    return system, users


def run_chat(llm: LLM, system: list[int], users: list[list[list[int]]], answer_len: int,
             starts: list[float]) -> tuple[list[dict], float]:
    """Every turn of every conversation, each submitted when the turn before it finished; one
    record per request and the seconds the run took."""
    history = [list(system) for _ in users]  # each conversation's tokens so far
    running = {}  # Request -> (conversation, turn)
    order = sorted(range(len(users)), key=lambda c: starts[c])  # conversations not started
    records = []

    def submit(conversation: int, turn: int) -> None:
        history[conversation] += users[conversation][turn]
        params = greedy(answer_len, seed=conversation * len(users[0]) + turn)
        running[llm.add_request(list(history[conversation]), params)] = (conversation, turn)

    begin = time.perf_counter()
    while order or running:
        elapsed = time.perf_counter() - begin
        while order and starts[order[0]] <= elapsed:
            submit(order.pop(0), 0)
        if not llm.has_unfinished_requests:
            time.sleep(max(0.0, starts[order[0]] - elapsed))
            continue
        for request in llm.step():
            conversation, turn = running.pop(request)
            output = llm.get_output(request)
            records.append(dict(conversation=conversation, turn=turn,
                                prompt_tokens=request.num_prompt_tokens,
                                cached_tokens=output.num_cached_tokens,
                                ttft_s=output.metrics.time_to_first_token_s,
                                token_ids=output.token_ids))
            history[conversation] += output.token_ids
            if turn + 1 < len(users[conversation]):
                submit(conversation, turn + 1)
    return records, time.perf_counter() - begin


def chat_summary(records: list[dict], seconds: float) -> dict:
    first = [r for r in records if r["turn"] == 0]
    later = [r for r in records if r["turn"] > 0]

    def hit_rate(rs: list[dict]) -> float | None:
        prompt = sum(r["prompt_tokens"] for r in rs)
        return sum(r["cached_tokens"] for r in rs) / prompt if prompt else None

    return {
        "requests": len(records), "seconds": seconds,
        "output_tokens_per_s": sum(len(r["token_ids"]) for r in records) / seconds,
        "turn1_ttft_p50_ms": percentile_ms([r["ttft_s"] for r in first], 50),
        "turn1_ttft_p99_ms": percentile_ms([r["ttft_s"] for r in first], 99),
        "later_ttft_p50_ms": percentile_ms([r["ttft_s"] for r in later], 50),
        "later_ttft_p99_ms": percentile_ms([r["ttft_s"] for r in later], 99),
        "hit_rate": hit_rate(records), "later_hit_rate": hit_rate(later),
    }


def conversation_starts(num: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * num
    return np.cumsum(np.random.default_rng([seed, 2]).exponential(1 / rate, num)).tolist()


def scenario_chat(args: argparse.Namespace, vocab_size: int) -> dict:
    system, users = chat_workload(args, vocab_size, args.seed, args.num_conversations,
                                  args.num_turns)
    warm_system, warm_users = chat_workload(args, vocab_size, args.seed + 1, 2, 2)
    longest = args.system_len + args.num_turns * (round(1.25 * args.user_len) + args.answer_len)
    starts = conversation_starts(len(users), args.conversation_rate, args.seed)
    runs, outputs = {}, {}
    for caching in (True, False):
        llm = make_llm(args, longest + 16, args.num_conversations,
                       enable_prefix_caching=caching)
        run_chat(llm, warm_system, warm_users, args.answer_len, [0.0, 0.0])
        records, seconds = run_chat(llm, system, users, args.answer_len, starts)
        del llm
        name = "caching" if caching else "no caching"
        runs[name] = chat_summary(records, seconds)
        outputs[name] = {(r["conversation"], r["turn"]): r["token_ids"] for r in records}
        print(f"chat, {name}: {len(records)} requests in {seconds:.1f} s", flush=True)
    mismatches = sum(outputs["caching"][key] != outputs["no caching"].get(key)
                     for key in outputs["caching"])
    on, off = runs["caching"]["later_ttft_p50_ms"], runs["no caching"]["later_ttft_p50_ms"]
    ratio = on / off if on is not None and off else None
    return {"runs": runs, "later_ttft_p50_ratio": ratio, "goal": CHAT_GOAL,
            "met": ratio is not None and ratio <= CHAT_GOAL, "mismatches": mismatches,
            "compared": len(outputs["caching"])}


# ----------------------------------------------------------------- 2. long prompt mid-decode


def per_token_itls(times: list[float], counts: list[int]) -> list[float]:
    """Gaps between the steps that gave a stream tokens; n tokens in a step: n gaps of 1/n."""
    itls = []
    for prev, now, n in zip(times, times[1:], counts[1:]):
        itls += [(now - prev) / n] * n
    return itls


def run_long(llm: LLM, stream_prompts: list[list[int]], stream_output_len: int,
             long_prompt: list[int], long_after: int) -> dict:
    """The streams, the long prompt once each stream has ``long_after`` tokens; each stream's
    ITLs and the long prompt's time to first token."""
    streams = [llm.add_request(p, greedy(stream_output_len, seed=i))
               for i, p in enumerate(stream_prompts)]
    seen = [0] * len(streams)
    times: list[list[float]] = [[] for _ in streams]
    counts: list[list[int]] = [[] for _ in streams]
    long_request = None
    while llm.has_unfinished_requests:
        llm.step()
        now = time.perf_counter()
        for i, request in enumerate(streams):
            n = request.num_output_tokens
            if n > seen[i]:
                times[i].append(now)
                counts[i].append(n - seen[i])
                seen[i] = n
        if long_request is None and min(seen) >= long_after:
            long_request = llm.add_request(long_prompt, greedy(8, seed=len(streams)))
    if long_request is None:
        raise ValueError(f"the streams ended before each had --long-after={long_after} tokens")
    return {"itls": [per_token_itls(t, c) for t, c in zip(times, counts)],
            "long_ttft_s": llm.get_output(long_request).metrics.time_to_first_token_s}


def long_summary(result: dict) -> dict:
    everything = [x for itls in result["itls"] for x in itls]
    median = float(np.median(everything))
    return {
        "itl_p50_ms": median * 1000, "itl_p99_ms": percentile_ms(everything, 99),
        "itl_max_ms": max(everything) * 1000, "worst_over_median": max(everything) / median,
        "worst_stream_ratio": max(max(s) / float(np.median(s)) for s in result["itls"] if s),
        "long_ttft_ms": result["long_ttft_s"] * 1000, "num_itls": len(everything),
    }


def scenario_long(args: argparse.Namespace, vocab_size: int) -> dict:
    rng = np.random.default_rng([args.seed, 3])
    streams = [rng.integers(0, vocab_size, args.stream_prompt_len).tolist()
               for _ in range(args.num_streams)]
    long_prompt = rng.integers(0, vocab_size, args.long_prompt_len).tolist()
    warm_long = rng.integers(0, vocab_size, args.long_prompt_len).tolist()
    runs = {}
    for chunked in (True, False):
        llm = make_llm(args, max(args.long_prompt_len + 8,
                                 args.stream_prompt_len + args.stream_output_len) + 16,
                       args.num_streams + 1, enable_chunked_prefill=chunked,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       prefill_attention_budget=args.prefill_attention_budget if chunked
                       else None)
        run_long(llm, streams[:2], args.long_after + 8, warm_long, args.long_after)
        result = run_long(llm, streams, args.stream_output_len, long_prompt, args.long_after)
        del llm
        name = "chunked" if chunked else "not chunked"
        runs[name] = long_summary(result)
        print(f"long prompt, {name}: worst ITL {runs[name]['itl_max_ms']:.1f} ms", flush=True)
    ratio = runs["chunked"]["worst_over_median"]
    return {"runs": runs, "goal": LONG_GOAL, "met": ratio <= LONG_GOAL}


# ----------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="chat,long", help="(default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="default: a random 8B-shaped target")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random target and every size scaled down (smoke runs)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                          "verispec_bench_models"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--speculative-config", default="none",
                        help="none, ngram, eagle3 or a speculative_config JSON object")
    parser.add_argument("--conversation-rate", type=float, default=math.inf,
                        help="conversations started per second, Poisson (default: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-attention-budget", type=int, default=None,
                        help="the chunked engine's prefill_attention_budget: (query, key) "
                        "pairs of a step's prefill chunks while streams decode (default: none)")
    for name in SIZES:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"(default: {SIZES[name][0]}; --tiny: {SIZES[name][1]})")
    args = parser.parse_args(argv)
    for name, (default, tiny) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else default)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.scenarios = [s.strip() for s in args.scenarios.split(",")]
    if not set(args.scenarios) <= {"chat", "long"} or not args.scenarios:
        parser.error(f"--scenarios are chat and/or long, got {args.scenarios}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model is None:
        args.model = target_checkpoint(args.workdir, args.tiny, args.device)
    args.spec = speculative_config(args.speculative_config, args.model, args.workdir,
                                   args.device)
    vocab_size = model_config(args.model)["vocab_size"]
    result = {"benchmark": "bench_prefix", "hardware": machine_description(),
              "device": args.device, "model": args.model,
              "speculative_config": config_label(args.speculative_config),
              "sizes": {name: getattr(args, name) for name in SIZES}}
    if "chat" in args.scenarios:
        result["chat"] = scenario_chat(args, vocab_size)
    if "long" in args.scenarios:
        result["long"] = scenario_long(args, vocab_size)
    print(f"\nhardware: {result['hardware']}; device {args.device}; model {args.model}; "
          f"speculation {result['speculative_config']}")
    if "chat" in result:
        chat = result["chat"]
        print(f"\nmulti-turn chat: {args.num_conversations} conversations x {args.num_turns} "
              f"turns, system {args.system_len}, user ~{args.user_len}, answers "
              f"{args.answer_len} tokens (TTFT in ms)")
        print_table([{"prefix caching": name, **row} for name, row in chat["runs"].items()])
        ratio = chat["later_ttft_p50_ratio"]
        print(f"turns 2.. TTFT p50, caching / none: "
              f"{'n/a' if ratio is None else f'{ratio:.3f}'} (goal <= {CHAT_GOAL}: "
              f"{'met' if chat['met'] else 'not met'}); outputs differing: "
              f"{chat['mismatches']} of {chat['compared']}")
    if "long" in result:
        long = result["long"]
        print(f"\nlong prompt during decoding: {args.num_streams} streams, a "
              f"{args.long_prompt_len}-token prompt after {args.long_after} tokens, "
              f"max_num_batched_tokens {args.max_num_batched_tokens} (ITL in ms)")
        print_table([{"prefill": name, **row} for name, row in long["runs"].items()])
        print(f"worst / median ITL with chunked prefill: "
              f"{long['runs']['chunked']['worst_over_median']:.2f} (goal <= {LONG_GOAL}: "
              f"{'met' if long['met'] else 'not met'})")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
