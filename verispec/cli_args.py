"""The ``verispec`` command line's shared flag groups and their conversion into the API's
arguments: engine flags onto ``LLM`` arguments (``ENGINE_FLAGS``), speculative flags onto the
fields of ``SpeculativeConfig`` (``SPEC_FLAGS``), sampling flags onto the fields of
``SamplingParams`` (generated from the dataclass, so a new field gets a flag). The subcommands
of ``verispec.cli`` add these groups to their parsers and call the conversions
(``engine_kwargs``, ``speculative_config``, ``sampling_params``) on the parsed flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from verispec.config import SpeculativeConfig
from verispec.proposers import available_proposers
from verispec.sampling_params import SamplingParams

# LLM(...) argument -> (flag options). The flag name is the argument with dashes.
ENGINE_FLAGS: dict[str, dict] = {
    "model": dict(default=None, help="local HF model directory or .gguf file "
                  "(default: the bundled SmolLM2-135M-Instruct)"),
    "dtype": dict(default=None, choices=["bfloat16", "float32"],
                  help="weights and activations (default: a .gguf, the bundled model "
                  "included, keeps its quantised weights on the CPU; anything else bfloat16); "
                  "bfloat16 or float32 dequantise a .gguf"),
    "max_model_len": dict(type=int, default=None, help="most tokens per request (default: the "
                          "model's max_position_embeddings; refused at start when the KV pool "
                          "cannot hold one request of this length)"),
    "max_num_seqs": dict(type=int, default=None,
                         help="requests running at once (default: 256 on CUDA, 8 on CPU)"),
    "block_size": dict(type=int, default=16,
                       help="tokens per KV cache block, a power of two (default: %(default)s)"),
    "gpu_memory_utilization": dict(
        type=float, default=0.9, help="on CUDA, the fraction of GPU memory for weights, "
        "activations and the KV pool, in (0, 1]; the pool gets what weights and the largest "
        "step leave (default: %(default)s)"),
    "kv_cache_memory": dict(
        default=None, help="bytes of the KV pool, e.g. 4GiB or 512MiB (CPU default: enough for "
        "max-num-seqs full-length requests, at most 1GiB; on CUDA it overrides "
        "--gpu-memory-utilization). Too small for one max-model-len request: refused at start"),
    "max_num_batched_tokens": dict(
        type=int, default=None, help="most tokens one step computes: with chunked prefill the "
        "running requests' decode tokens and prefill chunks together (default 2048), without "
        "it a prefill step's prompt tokens (default 8192; a longer prompt runs alone)"),
    "prefill_attention_budget": dict(
        type=int, default=None, help="with chunked prefill, the most (query, key) pairs a "
        "step's prefill chunks attend while other requests decode, so a chunk at a long "
        "context does not stall them (default: no bound)"),
    "enable_prefix_caching": dict(
        action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV of earlier requests' identical first tokens (shared system prompts, "
        "earlier chat turns); --no-enable-prefix-caching computes every prompt (default: on, "
        "off for hybrid models)"),
    "enable_chunked_prefill": dict(
        action=argparse.BooleanOptionalAction, default=None,
        help="split long prompts over steps shared with the running requests' decodes; "
        "--no-enable-chunked-prefill prefills whole prompts in steps of their own (default: "
        "on, off for hybrid models)"),
    "async_scheduling": dict(
        action=argparse.BooleanOptionalAction, default=None,
        help="plain decoding: queue each step before the host commits the one before, so the "
        "GPU does not wait for the host between steps (default: on with CUDA, off on the "
        "CPU and with speculation)"),
    "device": dict(default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)"),
    "tensor_parallel_size": dict(
        type=int, default=1, help="GPUs (CPU processes) one model is split over: the engine "
        "starts the other ranks itself (on cuda:N.. cuda:N+size-1), or runs one rank per "
        "process under torchrun (default: %(default)s)"),
    "load_format": dict(default="auto", choices=["auto", "dummy"],
                        help="auto reads the weights; dummy makes random ones from config.json "
                        "alone, for benchmarks (default: %(default)s)"),
    "enforce_eager": dict(action="store_true",
                          help="on CUDA, run every step eagerly instead of replaying the CUDA "
                          "graphs captured at start-up (default: off)"),
    "batch_invariant": dict(action=argparse.BooleanOptionalAction, default=True,
                            help="matmuls and attention whose rows do not depend on the batch, "
                            "so a request's tokens are the same alone or in any batch; "
                            "--no-batch-invariant uses cuBLAS on CUDA and torch's own CPU "
                            "matmul choices (default: on)"),
}
# SamplingParams field -> CLI default when it differs from the dataclass default.
SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}
SAMPLING_HELP = {
    "temperature": "0 = greedy",
    "top_k": "0 = off",
    "top_p": "1.0 = off",
    "min_p": "0.0 = off",
    "seed": "per-request seed (default: drawn at random)",
    "max_tokens": "most tokens generated per request",
    "stop": "stop string (repeatable; default: none)",
    "stop_token_ids": "stop token id (repeatable; default: none)",
    "ignore_eos": "keep generating past the EOS token (default: off)",
    "presence_penalty": "in [-2, 2], subtracted once from every token the output holds",
    "frequency_penalty": "in [-2, 2], subtracted per occurrence in the output",
    "repetition_penalty": "> 0, 1 = off; divides (multiplies) the positive (negative) logits "
                          "of tokens in the prompt or the output",
    "logit_bias": "TOKEN_ID=BIAS added to that token's logit, clamped to [-100, 100] "
                  "(repeatable; default: none)",
    "allowed_token_ids": "the only token ids that may be generated (repeatable; default: all)",
    "bad_words": "a word never to generate (repeatable; default: none)",
    "min_tokens": "EOS and stop token ids are masked until this many tokens are out",
    "structured_outputs": "a JSON object of one of json (a schema), json_object, regex, choice, "
                          "grammar (EBNF), e.g. '{\"regex\": \"[0-9]+\"}' (default: none)",
}
# SamplingParams fields with no flag: their results are returned by the Python API and the
# server (``verispec serve``), and the terminal commands have no place to show them.
SAMPLING_API_ONLY = ("logprobs", "prompt_logprobs", "n", "best_of")
# Repeatable flags: SamplingParams field -> the type of one value (None when never given).
SAMPLING_LISTS = {"stop": str, "stop_token_ids": int, "allowed_token_ids": int,
                  "bad_words": str}


def _logit_bias_item(text: str) -> tuple[int, float]:
    """``TOKEN_ID=BIAS`` -> (token id, bias)."""
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--logit-bias takes TOKEN_ID=BIAS, got {text!r}") from None


def _json_object(text: str) -> dict:
    """``--structured-outputs``: a JSON object (its fields checked by SamplingParams)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"--structured-outputs takes a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"--structured-outputs takes a JSON object, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (LLM arguments)")
    for name, options in ENGINE_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, **options)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (SamplingParams fields)")
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.name in SAMPLING_API_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = SAMPLING_DEFAULTS.get(f.name, getattr(defaults, f.name))
        help_text = SAMPLING_HELP.get(f.name)
        if f.name in SAMPLING_LISTS:
            group.add_argument(flag, dest=f.name, type=SAMPLING_LISTS[f.name], action="append",
                               default=[] if default is not None else None, help=help_text)
        elif f.name == "logit_bias":
            group.add_argument(flag, dest=f.name, type=_logit_bias_item, action="append",
                               metavar="TOKEN_ID=BIAS", help=help_text)
        elif isinstance(default, bool):
            group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
        elif f.name == "seed":
            group.add_argument(flag, dest=f.name, type=int, default=default, help=help_text)
        elif f.name == "structured_outputs":
            group.add_argument(flag, dest=f.name, type=_json_object, metavar="JSON",
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=type(default), default=default,
                               help=" ".join(filter(None, [help_text, "(default: %(default)s)"])))


# SpeculativeConfig field -> (flag, options). Defaults are None so that a flag the user gave can
# be told from one they did not (a --speculative-config JSON plus such flags is an error).
SPEC_FLAGS: dict[str, tuple[str, dict]] = {
    "method": ("--speculative-method", dict(
        help="proposer, or none (default: ngram)")),
    "num_speculative_tokens": ("--num-speculative-tokens", dict(type=int, help="k (default: 3)")),
    "model": ("--draft-model", dict(help="draft model directory or .gguf (draft_model; "
                                    "default: none)")),
    "num_draft_layers": ("--draft-layers", dict(type=int, help="N target layers (early_exit; "
                                                "default: none)")),
    "draft_sample_method": ("--draft-sample-method", dict(choices=["greedy", "probabilistic"],
                                                          help="(default: greedy)")),
    "speculative_token_tree": ("--speculative-token-tree", dict(
        help="a static token tree in vLLM's format, a list of paths of child indices, e.g. "
        "'[(0,), (1,), (0, 0), (1, 0)]'; its depth is k (draft_model, eagle, eagle3; CPU; "
        "default: a chain)")),
    "speculative_eagle_topk": ("--speculative-eagle-topk", dict(
        type=int, help="EAGLE-2's dynamic tree: children per node and nodes expanded per "
        "level, k levels (eagle, eagle3; CPU; with --speculative-num-draft-tokens; default: "
        "a chain)")),
    "speculative_num_draft_tokens": ("--speculative-num-draft-tokens", dict(
        type=int, help="the dynamic tree's tokens verified per request, the last committed "
        "one included, as in SGLang (default: none)")),
    "prompt_lookup_min": ("--prompt-lookup-min", dict(type=int, help="(ngram; default: 5)")),
    "prompt_lookup_max": ("--prompt-lookup-max", dict(type=int, help="(ngram; default: 5)")),
    "synthetic_acceptance_length": ("--synthetic-acceptance-length", dict(
        type=float, help="benchmark at this mean acceptance length (synthetic mode; "
        "default: off)")),
    "synthetic_acceptance_rates": ("--synthetic-acceptance-rates", dict(
        help="comma-separated unconditional per-position rates (synthetic mode; "
        "default: off)")),
}


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (SpeculativeConfig fields)")
    for name, (flag, options) in SPEC_FLAGS.items():
        if name == "method":
            options = dict(options, choices=available_proposers() + ["none"])
        if "choices" not in options:
            options = dict(options, metavar=name.upper())
        group.add_argument(flag, dest="spec_" + name, default=None, **options)
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="a vLLM speculative_config dict as JSON (instead of the flags "
                       "above; default: none)")


def speculative_config(args: argparse.Namespace):
    """The SpeculativeConfig the flags describe, or None for ``--speculative-method none``."""
    given = {name: getattr(args, "spec_" + name) for name in SPEC_FLAGS
             if getattr(args, "spec_" + name) is not None}
    if args.speculative_config is not None:
        if given:
            flags = ", ".join(SPEC_FLAGS[name][0] for name in given)
            raise ValueError(f"--speculative-config cannot be combined with {flags}")
        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--speculative-config is not valid JSON ({e}): {args.speculative_config!r}"
            ) from None
        if isinstance(config, dict) and config.get("method") == "none":
            return None
        return SpeculativeConfig.from_dict(config)
    if given.get("method", "ngram") == "none":
        return None
    rates = given.get("synthetic_acceptance_rates")
    if rates is not None:
        try:
            given["synthetic_acceptance_rates"] = [float(x) for x in rates.split(",")]
        except ValueError:
            raise ValueError(
                f"--synthetic-acceptance-rates must be comma-separated numbers, got {rates!r}"
            ) from None
    if "synthetic_acceptance_rates" in given or "synthetic_acceptance_length" in given:
        given["rejection_sample_method"] = "synthetic"
    return SpeculativeConfig(**given)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)
              if f.name not in SAMPLING_API_ONLY}
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = dict(fields["logit_bias"])
    return SamplingParams(**fields)
