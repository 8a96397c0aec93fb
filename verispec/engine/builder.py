"""Building an engine: the model, its runner, the proposer, the memory plan, the scheduler.

``build_engine`` fills in the state an ``LLM`` (``engine.llm``) steps over (the attributes
``engine.stepping.StepLoop`` declares, and the rest ``LLM`` reads): it loads the model, makes
the runner, the sampler and the proposer, sizes the KV pool once a step has been measured
(``runtime.memory``), builds the scheduler and captures the CUDA graphs. Every rank of a
tensor-parallel engine runs it with the same arguments.
"""

from __future__ import annotations

import functools
import logging

from verispec.engine import inputs
from verispec.engine.args import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs, feature
from verispec.engine.scheduler import Scheduler
from verispec.engine.spec_decode import SpeculativeDecoder
from verispec.engine.stepping import StepLoop
from verispec.models import parallel
from verispec.models.loader import load_model, parse_dtype
from verispec.runtime import memory
from verispec.runtime.model_runner import ModelRunner
from verispec.runtime.prefix_cache import PrefixCache
from verispec.sample.options import SamplingOptions
from verispec.sample.sampler import Sampler

logger = logging.getLogger("verispec")

# On the CPU a forward of more tokens runs in pieces of at most this many (the same bits: every
# row is computed alike): the kernels reach their rate at a few hundred rows (ops/quant_linear.c
# takes 128 at a time), and a 1 750-token prompt held ~35 MiB more activations in one piece than
# in pieces of 512 (docs/benchmarks.md).
CPU_MAX_FORWARD_TOKENS = 512


def build_engine(llm: StepLoop, args: EngineArgs) -> None:
    """Build the engine ``llm`` (an ``LLM`` on this rank: its ``device`` and ``_tp`` set) from
    validated ``args``, up to its captured steps; ``LLM`` then sets up its requests."""
    dtype, max_model_len, max_num_seqs = args.dtype, args.max_model_len, args.max_num_seqs
    max_num_batched_tokens = args.max_num_batched_tokens
    speculative_config = args.speculative_config
    llm._tp = parallel.with_peer_all_reduce(
        llm._tp, llm.device, parse_dtype("bfloat16" if dtype is None else dtype))
    llm.loaded = load_model(args.model, dtype, llm.device, tp=llm._tp,
                            load_format=args.load_format)
    config = llm.loaded.config
    llm.enable_prefix_caching = feature("enable_prefix_caching",
                                        args.enable_prefix_caching, config)
    llm.enable_chunked_prefill = feature("enable_chunked_prefill",
                                         args.enable_chunked_prefill, config)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS[llm.enable_chunked_prefill]
    llm.max_num_batched_tokens = max_num_batched_tokens
    llm.model_config = config
    async_scheduling = args.async_scheduling
    if async_scheduling is None:
        async_scheduling = llm.device.type == "cuda" and speculative_config is None
    llm.async_scheduling = async_scheduling
    llm.tokenizer = llm.loaded.tokenizer
    llm.eos_token_ids = frozenset(llm.loaded.eos_token_ids)
    if max_model_len is None:
        max_model_len = config.max_position_embeddings
    elif max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    llm.max_model_len = max_model_len
    llm.max_num_seqs = max_num_seqs
    llm.encoder = inputs.PromptEncoder(llm.tokenizer, config.vocab_size, max_model_len)
    k = 0 if speculative_config is None else speculative_config.num_speculative_tokens
    llm.num_speculative_tokens = k
    # the most drafts a request verifies in a step: k, or a token tree's nodes
    max_drafts = k
    if speculative_config is not None:
        max_drafts = speculative_config.max_tree_tokens
    # The runner starts on a pool of a few blocks; the memory plan sizes it once the
    # proposer (whose caches share the blocks) is built and a step has been measured.
    llm.runner = ModelRunner(llm.loaded.model, max_num_seqs, max_model_len, llm.device,
                             max_step_tokens=max_drafts + 1, enforce_eager=args.enforce_eager,
                             batch_invariant=args.batch_invariant, block_size=args.block_size,
                             num_blocks=2)
    if llm.runner.hybrid and llm.async_scheduling:
        if args.async_scheduling:
            raise ValueError("async_scheduling=True: a hybrid model's steps run in order (its "
                             "recurrent state advances with every queued step)")
        llm.async_scheduling = False
    llm.sampler = Sampler()
    llm.options = SamplingOptions(max_num_seqs, config.vocab_size, llm.device)
    llm.options.attach(llm.runner)  # before the memory plan: the counts are in use
    llm.spec = None if speculative_config is None else SpeculativeDecoder(
        speculative_config, llm.runner, config.vocab_size, max_num_seqs, max_model_len,
        tokenizer=llm.tokenizer, tp=llm._tp, options=llm.options,
        load_format=args.load_format,
    )
    # Longer forwards run in pieces: the memory plan measures a step of this many tokens.
    forward_tokens = (max_num_batched_tokens if llm.device.type != "cpu"
                      else min(max_num_batched_tokens, CPU_MAX_FORWARD_TOKENS))
    llm.runner.max_forward_tokens = forward_tokens
    draft_runner = None if llm.spec is None else llm.spec.proposer.runner
    if draft_runner is not None and draft_runner is not llm.runner:
        draft_runner.max_forward_tokens = forward_tokens
    llm._captured_query_counts = [1] if llm.spec is None else [1, k + 1]
    if llm.spec is not None and llm.spec.tree is not None:  # the trees' verify graph
        llm.runner.tree_graph = (llm.spec.tree.num_nodes_total + 1, llm.spec.tree.depth)
    llm.kv_plan = memory.plan_kv_pool(
        llm.runner, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        verify_rows=max_num_seqs * (max_drafts + 1),
        captured_query_counts=llm._captured_query_counts,
        utilization=args.gpu_memory_utilization, kv_bytes=args.kv_cache_memory, tp=llm._tp)
    logger.info("%s", llm.kv_plan.summary())
    # (a function of the proposer, not a method of the engine: no reference cycle keeps a
    # dropped engine and its CUDA graphs alive until a garbage collection, which could then
    # fall inside another engine's graph capture)
    on_preempt = None if llm.spec is None else functools.partial(llm.spec.release,
                                                                preempted=True)
    prefix_cache = None
    if llm.enable_prefix_caching:
        shifted = llm.spec is not None and llm.spec.proposer.shifted_inputs
        prefix_cache = PrefixCache(llm.runner.kv_cache.block_tables, shifted=shifted)
    llm.scheduler = Scheduler(max_num_seqs, llm.runner.kv_cache, max_num_batched_tokens,
                              lookahead=max_drafts + 1, on_preempt=on_preempt,
                              chunked_prefill=llm.enable_chunked_prefill,
                              prefix_cache=prefix_cache,
                              prefill_attention_budget=args.prefill_attention_budget)
    # CUDA graphs (no-op on CPU and with enforce_eager): decode, verify, the proposer's draft
    llm.runner.capture(llm._captured_query_counts)
    llm.runner.capture_tree()
    llm.runner.warm_up_kernels()  # the eager prefill steps' kernel variants (CUDA)
    if draft_runner is not None and llm.spec.proposer.own_causal_lm:
        draft_runner.warm_up_kernels()
    if llm.spec is not None:
        llm.spec.capture()
        # every rank plans its drafts with rank 0's measured step costs
        llm.spec.costs = llm._tp.broadcast_object(llm.spec.costs)
    if llm.runner.graphs is not None:
        llm.runner.graphs.log_summary("target")
