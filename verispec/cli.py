"""``verispec`` command line: thin argparse front-ends over the Python API.

Each subcommand registers an ``add_arguments(parser)`` and a ``run(args)``. Flags map 1:1 onto
fields: engine flags onto ``LLM`` arguments (``ENGINE_FLAGS``), sampling flags onto the fields of
``SamplingParams`` (generated from the dataclass, so a new field gets a flag); those shared flag
groups and their conversion into configs are in ``verispec.cli_args``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable

from verispec.bench import run as bench_run
from verispec.bench.prompts import RandomPrompts, get_prompts
from verispec.bench.report import plot_acceptance_and_speedup, print_table
from verispec.cli_args import (
    add_engine_args,
    add_sampling_args,
    add_speculative_args,
    engine_kwargs,
    sampling_params,
    speculative_config,
)
from verispec.engine.llm import LLM
from verispec.train.train_draft import TrainDraftConfig, train_draft

# ----------------------------------------------------------------------------- generate


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--no-chat", action="store_true",
                        help="send the prompt as plain text, without the chat template "
                        "(default: off)")
    add_engine_args(parser)
    add_speculative_args(parser)
    add_sampling_args(parser)


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give the text to generate from")
    params = sampling_params(args)
    llm = LLM(**engine_kwargs(args), speculative_config=speculative_config(args))
    chat = not args.no_chat and getattr(llm.tokenizer, "chat_template", None)
    prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
    start = time.perf_counter()
    shown, output = "", None
    for output in llm.generate_stream(prompt, params):
        sys.stdout.write(output.text[len(shown):])
        sys.stdout.flush()
        shown = output.text
    elapsed = time.perf_counter() - start
    n = len(output.token_ids) if output else 0
    ttft = output.metrics.time_to_first_token_s if output else None
    print(file=sys.stdout)
    print(
        f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s; "
        f"time to first token {ttft or 0:.3f} s; finish_reason={output.finish_reason}]",
        file=sys.stderr,
    )
    line = llm.spec_decoding_log_line(elapsed)
    if line:
        print(line, file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- bench


# ``--prompts random`` without ``--num-prompts``: as many prompts as a built-in set holds.
RANDOM_NUM_PROMPTS = 10


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="grounded",
                        help="built-in text set (grounded, free), random (token ids drawn "
                        "from the model's vocabulary; no tokenizer needed) or a JSONL file of "
                        '{"prompt": "..."} or {"prompt_token_ids": [...]} lines '
                        "(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="use the first N prompts (default: all; "
                        f"{RANDOM_NUM_PROMPTS} for random)")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="tokens per prompt of --prompts random (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts per generate call (default: %(default)s)")
    parser.add_argument("--k-values", default=None,
                        help="comma-separated k to sweep (default: --num-speculative-tokens)")
    parser.add_argument("--no-chat", action="store_true",
                        help="text prompts without the chat template (default: off)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the rows as JSON (default: not written)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw per-position acceptance and speedup against k (matplotlib; "
                        "default: not drawn)")
    add_engine_args(parser)
    add_speculative_args(parser)
    add_sampling_args(parser)
    parser.set_defaults(max_tokens=64)


def _check_output_file(flag: str, path: str) -> None:
    """ValueError unless ``path`` can be written: checked before the run, not after it."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {path!r}: the directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK) or (os.path.exists(path)
                                              and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path!r} is not writable")


def check_bench_args(args: argparse.Namespace) -> list[int] | None:
    """Check the bench flags that need no model, each with one clear error (before any run);
    returns the ``--k-values`` list, or None when not given."""
    for flag, value in (("--num-prompts", args.num_prompts), ("--batch-size", args.batch_size),
                        ("--prompt-len", args.prompt_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    ks = None
    if args.k_values is not None:
        parts = [k.strip() for k in args.k_values.split(",")]
        if not all(k.isdigit() and int(k) >= 1 for k in parts):
            raise ValueError(
                f"--k-values must be comma-separated integers >= 1, got {args.k_values!r}"
            )
        ks = [int(k) for k in parts]
    if args.json:
        _check_output_file("--json", args.json)
    if args.plot:
        _check_output_file("--plot", args.plot)
        try:
            import matplotlib.figure  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib, which is not installed: pip install 'verispec[plot]'"
            ) from None
    return ks


def run_bench(args: argparse.Namespace) -> int:
    ks = check_bench_args(args)
    config = speculative_config(args)
    if config is None:
        raise ValueError("verispec bench compares against speculation: pick a method")
    configs = []
    for k in ks or [config.num_speculative_tokens]:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        if config.is_synthetic and config.synthetic_acceptance_rates is not None and k != len(
                config.synthetic_acceptance_rates):
            raise ValueError("--k-values cannot change k with --synthetic-acceptance-rates")
        if config.speculative_token_tree is not None and k != config.num_speculative_tokens:
            raise ValueError("--k-values cannot change k with --speculative-token-tree (its "
                             "depth is k)")
        if config.is_tree:  # a tree is measured beside the chain of the same k
            chain = dict(fields, speculative_token_tree=None, speculative_eagle_topk=None,
                         speculative_num_draft_tokens=None)
            configs.append(type(config)(**dict(chain, num_speculative_tokens=k)))
        configs.append(type(config)(**dict(fields, num_speculative_tokens=k)))
    if args.prompts == "random":
        prompts = RandomPrompts(args.num_prompts or RANDOM_NUM_PROMPTS, args.prompt_len)
    else:
        prompts = get_prompts(args.prompts)[: args.num_prompts]
    rows = bench_run.run_bench(engine_kwargs(args), configs, prompts, sampling_params(args),
                               args.batch_size, chat=not args.no_chat)
    columns = ["method", "k", "tree", "tokens_per_s", "speedup", "mean_acceptance_length",
               "acceptance_rate_per_pos", "draft_rate", "predicted_speedup",
               "measured_over_predicted", "c", "verify_cost", "step_cost"]
    print_table([{c: r.get(c) for c in columns} for r in rows])
    for r in rows[1:]:
        print(r["log_line"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.plot:
        plot_acceptance_and_speedup(rows, args.plot)
    print(json.dumps({"bench": rows}))
    return 0


# ----------------------------------------------------------------------------- serve


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the --model value, or the "
                        "bundled model's name)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="larger request bodies are refused with 413 before they are parsed "
                        "(default: 16 MiB)")
    add_engine_args(parser)
    add_speculative_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be an integer >= 1, got "
                         f"{args.max_request_bytes}")
    config = speculative_config(args)  # bad flags are refused before the model loads
    try:  # here, not at the top: fastapi and the server's modules take ~0.4 s to import
        from verispec.serve import run_server
    except ImportError as e:
        raise ValueError(f"verispec serve needs {e.name}: pip install -e .") from None
    return run_server(engine_kwargs(args), config, args.host, args.port, args.served_model_name,
                      args.max_request_bytes)


# ----------------------------------------------------------------------------- train-draft

# TrainDraftConfig field -> help; every field is a flag (--output-dir, --draft-vocab-size, ...).
TRAIN_DRAFT_HELP = {
    "output_dir": "directory the head is written to (and resumed from); load it with "
                  "--speculative-method eagle3 --draft-model DIR",
    "model": "target: local HF directory or .gguf file (default: the bundled model)",
    "prompts": 'JSONL file of {"prompt": ...} or {"messages": [...]} lines (default: the '
               "built-in set)",
    "num_prompts": "use the first N prompts of the set (default: all of a --prompts file, 5500 "
                   "of the 6400 built-in ones)",
    "max_new_tokens": "tokens generated per response",
    "temperature": "temperatures of the generated responses, taken in turn over the prompts "
                   "(0 = greedy)",
    "draft_vocab_size": "tokens of the head's own LM head (the most frequent in the data)",
    "ttt_steps": "draft steps unrolled per position in training (training-time test)",
    "epochs": "passes over the data",
    "batch_size": "sequences per optimizer step",
    "lr": "peak learning rate (AdamW, warm-up then cosine decay)",
    "warmup_steps": "optimizer steps of linear warm-up",
    "max_seq_len": "longest sequence trained on (longer ones are cut)",
    "save_every": "write the head and the training state every N steps",
    "seed": "seed of the data order and the initial weights",
    "dtype": "target dtype for generating and recording hidden states (default: the engine's: "
             "a .gguf, the bundled model included, keeps its quantised weights on the CPU, "
             "anything else bfloat16)",
    "device": "cpu, cuda or cuda:N: where the target generates and the head trains",
    "max_num_seqs": "requests generated at once",
    "aux_layers": "the three target layers the head reads (default: L // 2, halfway from it "
                  "to the last, the last: 15 22 29 for the bundled model)",
    "amp": "train with bfloat16 matmuls (float32 weights and optimizer) on a GPU and where "
           "the CPU has a fast bfloat16 matmul; --no-amp trains in float32",
}


def add_train_draft_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(TrainDraftConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        options = dict(help=TRAIN_DRAFT_HELP[f.name])
        if f.name == "output_dir":
            parser.add_argument(flag, dest=f.name, required=True, **options)
            continue
        if f.name == "dtype":
            options["choices"] = ["bfloat16", "float32"]
        if f.name == "temperature":
            kind, options["nargs"] = float, "+"
        if f.name == "aux_layers":
            kind, options["nargs"], options["metavar"] = int, 3, "LAYER"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, **options)
            continue
        if "default:" not in options["help"]:
            options["help"] += " (default: %(default)s)"
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default, **options)


def run_train_draft(args: argparse.Namespace) -> int:
    config = TrainDraftConfig(**{f.name: getattr(args, f.name)
                                 for f in dataclasses.fields(TrainDraftConfig)})
    summary = train_draft(config, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps({"train_draft": summary}))
    return 0


# ----------------------------------------------------------------------------- main

# name -> (help, add_arguments, run). Later subcommands (e.g. ``bench``) register here.
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "generate": ("generate text for a prompt, streamed to the terminal", add_generate_args,
                 run_generate),
    "bench": ("tokens/s and acceptance with and without speculation on a prompt set",
              add_bench_args, run_bench),
    "serve": ("an OpenAI-compatible HTTP server (completions, chat, Prometheus /metrics)",
              add_serve_args, run_serve),
    "train-draft": ("train an EAGLE-3 draft head for a target on its own generations",
                    add_train_draft_args, run_train_draft),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec", description="Fast, exact speculative decoding for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"verispec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's exit status for SIGINT
        print(f"\nverispec {args.command}: interrupted", file=sys.stderr)
        return 130


def console_main() -> None:
    """The ``verispec`` command. After a one-process ``generate`` it leaves without the
    interpreter's teardown (streams flushed, logging shut down, then ``os._exit``): the
    generation is over and torch's teardown alone is ~0.4 s of a ~3 s warm start
    (docs/benchmarks.md). Every other command (and ``main`` called in a process, as the tests
    do) exits normally."""
    code = main()
    argv = sys.argv[1:]
    if argv[:1] == ["generate"] and not any(a.startswith("--tensor-parallel-size")
                                            for a in argv):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
