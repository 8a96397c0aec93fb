"""``verispec`` command line: thin argparse front-ends over the Python API.

Each subcommand registers an ``add_arguments(parser)`` and a ``run(args)``. Flags map 1:1 onto
fields: engine flags onto ``LLM`` arguments (``ENGINE_FLAGS``), sampling flags onto the fields of
``SamplingParams`` (generated from the dataclass, so a new field gets a flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

from verispec.sampling_params import SamplingParams

# LLM(...) argument -> (flag options). The flag name is the argument with dashes.
ENGINE_FLAGS: dict[str, dict] = {
    "model": dict(default=None, help="local HF model directory or .gguf file "
                  "(default: the bundled SmolLM2-135M-Instruct)"),
    "dtype": dict(default="bfloat16", choices=["bfloat16", "float32"]),
    "max_model_len": dict(type=int, default=None, help="most tokens per request"),
    "max_num_seqs": dict(type=int, default=8, help="requests running at once"),
    "device": dict(default="cpu"),
}
# SamplingParams field -> CLI default when it differs from the dataclass default.
SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}
SAMPLING_HELP = {
    "temperature": "0 = greedy (the CLI default)",
    "top_k": "0 = off",
    "top_p": "1.0 = off",
    "min_p": "0.0 = off",
    "seed": "per-request seed (default: drawn at random)",
    "stop": "stop string (repeatable)",
    "stop_token_ids": "stop token id (repeatable)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (LLM arguments)")
    for name, options in ENGINE_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, **options)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (SamplingParams fields)")
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        default = SAMPLING_DEFAULTS.get(f.name, getattr(defaults, f.name))
        help_text = SAMPLING_HELP.get(f.name)
        if f.name in ("stop", "stop_token_ids"):
            kind = str if f.name == "stop" else int
            group.add_argument(flag, dest=f.name, type=kind, action="append", default=[],
                               help=help_text)
        elif isinstance(default, bool):
            group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
        else:
            kind = int if f.name == "seed" else type(default)
            group.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{f.name: getattr(args, f.name)
                             for f in dataclasses.fields(SamplingParams)})


# ----------------------------------------------------------------------------- generate


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--no-chat", action="store_true",
                        help="send the prompt as plain text, without the chat template")
    add_engine_args(parser)
    add_sampling_args(parser)


def run_generate(args: argparse.Namespace) -> int:
    from verispec.engine.llm import LLM

    params = sampling_params(args)
    llm = LLM(**engine_kwargs(args))
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
    return 0


# ----------------------------------------------------------------------------- main

# name -> (help, add_arguments, run). Later subcommands (e.g. ``bench``) register here.
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "generate": ("generate text for a prompt, streamed to the terminal", add_generate_args,
                 run_generate),
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


if __name__ == "__main__":
    sys.exit(main())
