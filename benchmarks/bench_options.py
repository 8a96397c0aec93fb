"""What sampling options and structured output cost a speculative step (issue goals: a step
with JSON-schema requests at most 1.1x, penalties at most 1.05x the same step without them).

One engine and one batch shape for every row, so the ratios come from one process: an
8B-shaped random target (``load_format="dummy"``) with the bundled model's tokenizer (its
vocabulary, 49 152), a 1B-shaped random draft model (``--spec draft``, the default) or n-gram
(``--spec ngram``), k = 3, ``--batch`` requests of random token prompts decoding ``--tokens``
tokens at temperature 1 (seeded). Rows, each over the same prompts:

- ``plain``: no option;
- ``penalties``: presence 0.5, frequency 0.5, repetition 1.1;
- ``json``: a JSON schema (``structured_outputs``), the proposer drafting under the grammar
  (docs/design.md §15);
- ``json (drafts ignore the grammar)``: the same with ``Proposer.grammar_aware = False``.

Per row: decode tokens/s, engine steps, mean step time (decode time / steps), mean acceptance
length, and the step time over ``plain``'s. Every request drafts k tokens at every step (the
planner's per-request switch is off), so each row's steps do the same speculative work. Random
weights accept few drafts, but a grammar's forced tokens (punctuation, keys) are accepted
whenever the draft proposes them, which is what grammar-aware drafting changes. ``--model`` /
``--device cpu`` run it on any model (the bundled one on the CPU as a smoke test).
``--draft-sample-method greedy`` drafts argmaxes. ``--profile ROW`` runs that row once more
under cProfile and prints the host functions by their own time (what a step spends outside the
device); ``--phases ROW`` runs it once more with the step's phases timed by the wall clock
(``profile_spec_host.PhaseTimer``: the proposer's draft, the grammar walks' masks and their
application, the verify step's options and masks, the waits for the device), in microseconds a
speculative step.

    python benchmarks/bench_options.py                       # GPU: 8B shape, batch 64
    python benchmarks/bench_options.py --device cpu --model bundled --batch 4 --tokens 16 \\
        --spec ngram

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tensor_parallel  # noqa: E402
import profile_spec_host  # noqa: E402

from verispec import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from verispec.bench.report import (  # noqa: E402
    machine_description,
    print_host_profile,
    print_table,
)
from verispec.models import gguf  # noqa: E402
from verispec.proposers import grammar_walk  # noqa: E402
from verispec.sample import grammar as grammar_module  # noqa: E402
from verispec.sample import options as options_module  # noqa: E402

K = 3
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "name", "scores", "tags", "active"],
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "scores": {"type": "array", "maxItems": 8, "items": {"type": "number"}},
        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["red", "green", "blue"]}},
        "active": {"type": "boolean"},
    },
}
ROWS = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "json": {"structured_outputs": StructuredOutputsParams(json=SCHEMA)},
    "json (drafts ignore the grammar)": {
        "structured_outputs": StructuredOutputsParams(json=SCHEMA)},
}


def model_dir(workdir: str, shape: str, tokenizer_dir: str | None = None) -> str:
    """A directory with ``shape``'s config.json (vocabulary 49 152) and the bundled tokenizer
    (or ``tokenizer_dir``'s: a directory with the bundled model's config.json and tokenizer)."""
    meta = tokenizer_dir or gguf.gguf_meta_dir(gguf.bundled_gguf_path())
    path = bench_tensor_parallel.write_config(workdir, shape)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(meta, "config.json")) as f:
        bundled = json.load(f)
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        if key in bundled:
            config[key] = bundled[key]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(meta):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(meta, name), path)
    return path


def run_row(llm: LLM, prompts: list, name: str, args) -> dict:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens,
                            ignore_eos=not name.startswith("json"), **ROWS[name])
    if llm.spec is not None:
        llm.spec.adaptive = False  # every row drafts k at every step: the same work per step
        llm.spec.proposer.grammar_aware = name != "json (drafts ignore the grammar)"
    llm.generate(prompts[:2], params)  # compiles the grammar, warms the option paths
    before_steps, before_stats = llm.num_steps, llm.get_metrics()["spec_decoding"] or {}
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    first = max(o.metrics.time_to_first_token_s for o in outputs)
    stats = llm.get_metrics()["spec_decoding"] or {}
    drafts = stats.get("num_draft_tokens", 0) - before_stats.get("num_draft_tokens", 0)
    accepted = stats.get("num_accepted_tokens", 0) - before_stats.get("num_accepted_tokens", 0)
    verify_steps = stats.get("num_drafts", 0) - before_stats.get("num_drafts", 0)
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = llm.num_steps - before_steps
    return dict(row=name, tokens=tokens, steps=steps, decode_tok_s=(tokens - len(prompts)) /
                max(seconds - first, 1e-9), step_ms=1e3 * (seconds - first) / max(steps - 1, 1),
                accept_len=(1 + accepted / verify_steps) if verify_steps else None,
                draft_tokens=drafts)


def host_phases(llm: LLM, prompts: list, name: str, args) -> dict[str, float]:
    """Run row ``name`` once more with its step's phases timed (the module docstring; the
    engine's phases as ``profile_spec_host``'s, ``step`` counting the prefills too):
    microseconds a speculative step, largest first. Every wrapped function is put back."""
    timer = profile_spec_host.PhaseTimer()
    timer.wrap_engine(llm)
    for owner, method in ((options_module, "fill_chain_masks"),
                          (grammar_module, "compute_masks"), (grammar_walk, "compute_masks"),
                          (grammar_walk, "begin_drafts"), (grammar_walk, "extend_drafts"),
                          (grammar_walk.GrammarWalks, "apply"),
                          (grammar_walk.GrammarWalks, "argmax"),
                          (grammar_walk.GrammarWalks, "advance")):
        timer.wrap(owner, method)
    undo = (profile_spec_host.time_event_waits(timer) if args.device.startswith("cuda")
            else (lambda: None))
    start = llm.spec.num_steps
    try:
        run_row(llm, prompts, name, args)
    finally:
        undo()
        timer.restore()
    steps = max(1, llm.spec.num_steps - start)
    return {k: 1e6 * v / steps for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None,
                        help="a model directory, or bundled (default: the 8B shape, random)")
    parser.add_argument("--spec", choices=["draft", "ngram"], default="draft")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--workdir", default="/tmp/bench_options")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--profile", default=None, choices=list(ROWS),
                        help="run this row again under cProfile: host functions by own time")
    parser.add_argument("--phases", default=None, choices=list(ROWS),
                        help="run this row again with the step's phases timed: microseconds a "
                             "speculative step")
    parser.add_argument("--shapes", default="8b,1b",
                        help="target and draft shapes of the random models (tiny,tiny: the "
                        "host's share of a step, on a CPU)")
    parser.add_argument("--draft-sample-method", choices=["probabilistic", "greedy"],
                        default="probabilistic",
                        help="the draft model's drafts: sampled (q passed to verification) or "
                             "argmaxes (a greedy walk masks only refused argmaxes)")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="the bundled model's config.json and tokenizer files, where its "
                             "package is not installed")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    kwargs = dict(device=args.device, max_num_seqs=args.batch, enable_prefix_caching=False)
    if args.model is None:
        shapes = args.shapes.split(",")
        if len(shapes) != 2 or not set(shapes) <= set(bench_tensor_parallel.SHAPES):
            parser.error(f"--shapes takes two of {sorted(bench_tensor_parallel.SHAPES)}, "
                         f"target then draft; got {args.shapes!r}")
        target_shape, draft_shape = shapes
        target = model_dir(args.workdir, target_shape, args.tokenizer_dir)
        kwargs.update(model=target, dtype="bfloat16", load_format="dummy",
                      max_model_len=2048,
                      kv_cache_memory="8GiB" if args.device.startswith("cuda") else "1GiB")
    else:
        target = None if args.model == "bundled" else args.model
        kwargs.update(model=target)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    if args.spec == "draft":
        if args.model is not None:
            parser.error("--spec draft builds a 1B-shaped random draft for the 8B shape: give "
                         "--spec ngram with --model")
        spec = {"method": "draft_model",
                "model": model_dir(args.workdir, draft_shape, args.tokenizer_dir),
                "num_speculative_tokens": K, "draft_sample_method": args.draft_sample_method}
    llm = LLM(speculative_config=spec, **kwargs)
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab, size=args.prompt_len).tolist()
               for _ in range(args.batch)]
    rows = [run_row(llm, prompts, name, args) for name in args.rows.split(",")]
    if args.profile:
        print_host_profile(f"the row {args.profile!r}",
                           lambda: run_row(llm, prompts, args.profile, args), rows=25)
    phases = None
    if args.phases:
        if llm.spec is None:
            parser.error("--phases times a speculative step")
        phases = host_phases(llm, prompts, args.phases, args)
    base = next((r["step_ms"] for r in rows if r["row"] == "plain"), None)
    for r in rows:
        r["step_vs_plain"] = None if base is None else r["step_ms"] / base
    print(f"{machine_description()}; {args.spec} ({args.draft_sample_method} drafts), k = {K}, "
          f"batch {args.batch}, {args.tokens} tokens, temperature 1")
    print_table(rows, ["row", "decode_tok_s", "steps", "step_ms", "step_vs_plain", "accept_len",
                       "tokens"])
    if phases is not None:
        print(f"host phases of the row {args.phases!r}, microseconds a speculative step (the "
              "waits for the device inside them; nested phases count in their callers too):")
        print_table([dict(phase=k, us=v) for k, v in phases.items()], ["phase", "us"])
    result = dict(device=machine_description(), spec=args.spec, batch=args.batch,
                  rows=rows, phases_us=phases)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
