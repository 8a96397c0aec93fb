"""``LLM``: load a model once, then ``generate`` for batches of prompts with continuous batching.

This module holds the public API (and starts the ranks of a tensor-parallel engine): building
the engine (model, runner, proposer, scheduler, memory plan) is ``engine.builder.build_engine``,
turning prompts into queued requests is ``engine.intake.RequestIntake`` and the step itself
(schedule, run the model, sample, commit) is ``engine.stepping.StepLoop``.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from verispec.config import SpeculativeConfig
from verispec.engine import inputs
from verispec.engine.args import DEFAULT_DTYPE, EngineArgs
from verispec.engine.builder import build_engine
from verispec.engine.intake import RequestIntake
from verispec.engine.request import Request, RequestOutput
from verispec.engine.samples import HeldSamples
from verispec.engine.stepping import StepLoop
from verispec.models.loader import check_tensor_parallel
from verispec.runtime import workers
from verispec.runtime.kv_cache import DEFAULT_BLOCK_SIZE
from verispec.sample.grammar_compiler import LazyCompiler
from verispec.sample.sampler import SamplingTensors, draw_seed
from verispec.sampling_params import SamplingParams


class LLM(StepLoop, RequestIntake):
    """A model ready to generate.

    Parameters
    ----------
    model : local HF directory, ``.gguf`` file, or None for the bundled SmolLM2-135M-Instruct
    dtype : ``"bfloat16"``, ``"float32"`` or None (default): a GGUF (the bundled model
        included) on the CPU keeps its quantised weights (float32 activations), anything else
        loads in bfloat16; an explicit dtype dequantises a GGUF
    max_model_len : most tokens (prompt + output) per request; default the model's
        ``max_position_embeddings``
    max_num_seqs : requests running at once; default 256 on CUDA, 8 on CPU
    block_size : tokens per KV cache block (a power of two; default 16)
    gpu_memory_utilization : on CUDA, the fraction of the GPU's memory the engine may use
        (weights, activations, KV pool); the KV pool gets what the rest leaves (default 0.9)
    kv_cache_memory : bytes of the KV pool (an int or a string such as ``"4GiB"``): on CPU,
        default enough for ``max_num_seqs`` full-length requests but at most 1 GiB (and at least
        one); on CUDA it overrides ``gpu_memory_utilization``
    max_num_batched_tokens : most tokens one step computes: with chunked prefill the running
        requests' decode / verify tokens and the prefill chunks together (default 2048),
        without it the prompt tokens of a prefill step (default 8192)
    enable_prefix_caching : reuse the KV of earlier requests' identical first tokens (a shared
        system prompt, the earlier turns of a chat): on by default, as in vLLM; off for hybrid
        (recurrent) models, whose states are not kept per block
    enable_chunked_prefill : split long prompts over several steps, each shared with the running
        requests' decodes, so a long prompt does not stall the others: on by default; off for
        hybrid models
    prefill_attention_budget : with chunked prefill, the most (query, key) pairs the prefill
        chunks of a step attend while other requests decode (a chunk of n tokens after s
        computed ones attends ``n * s + n (n + 1) / 2``), so a chunk deep in a long prompt is
        cut shorter and the decoding requests' step stays short; None (default): no bound
    speculative_config : SpeculativeConfig or a dict of vLLM ``speculative_config`` keys;
        None (or ``method="none"``) decodes one token per step
    device : torch device, default ``"cpu"``
    tensor_parallel_size : GPUs (or CPU processes) one model is split over (vLLM's key;
        default 1). In a plain process the engine spawns the other ranks itself and stops them
        at ``close`` (or exit); under ``torchrun`` each rank runs the script and builds its
        engine with the same arguments. Llama-family models (docs/design.md §14)
    load_format : ``"auto"`` reads the weights; ``"dummy"`` makes random weights on the device
        from ``config.json`` alone (benchmarks of big shapes; vLLM's meaning)
    enforce_eager : on CUDA, run every step eagerly instead of replaying captured CUDA graphs
        (vLLM's name); no effect on CPU
    async_scheduling : plain decoding queues each step on the device before the host commits
        the step before it (the next step's inputs take the sampled tokens on the device), so
        the GPU does not wait for the host's commit and scheduling between steps (vLLM's key);
        a request's tokens are those of the steps in order. Default: on with CUDA for plain
        decoding (every rank of a tensor-parallel engine queues the same steps), off
        otherwise; True with speculation is a ValueError. Steps of requests with logprobs,
        logits options or several samples run in order
    batch_invariant : matmuls and attention whose rows do not depend on the batch, on CUDA and
        on CPU (the default: a request's tokens are the same alone or in any batch, and greedy
        speculation emits the plain greedy tokens, in every dtype); False uses torch's own
        kernel choices (cuBLAS; on CPU oneDNN / MKL), faster for large verify steps
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype | None = DEFAULT_DTYPE,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        device: str | torch.device = "cpu",
        enforce_eager: bool = False,
        batch_invariant: bool = True,
        block_size: int = DEFAULT_BLOCK_SIZE,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | str | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = None,
        enable_chunked_prefill: bool | None = None,
        prefill_attention_budget: int | None = None,
        tensor_parallel_size: int = 1,
        load_format: str = "auto",
        async_scheduling: bool | None = None,
    ) -> None:
        engine_kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        args = EngineArgs(**engine_kwargs)  # ValueError naming the field
        self.enforce_eager = enforce_eager
        self.device = args.device
        self.speculative_config = args.speculative_config
        if tensor_parallel_size > 1:  # before any process starts
            check_tensor_parallel(model, tensor_parallel_size)
        # Ranks 1.. of a tensor-parallel engine (spawned here unless under torchrun) build
        # this same engine from engine_kwargs; from here on every rank runs the code below.
        self._tp, self.device, self._workers = workers.start(
            tensor_parallel_size, self.device, LLM, engine_kwargs)
        self.tensor_parallel_size = tensor_parallel_size
        try:
            args.device = self.device  # this rank's
            self._init_engine(args)
            if self._workers is not None:
                self._workers.wait_ready()
        except BaseException as e:
            failure = None if self._workers is None else self._workers.failure_after_error()
            self.close()
            # a rank that died first is the cause, unless it failed as this rank did
            if failure is not None and str(e) not in failure:
                raise workers.WorkerDied(failure) from e
            raise

    def _init_engine(self, args: EngineArgs) -> None:
        build_engine(self, args)  # model, runner, proposer, memory plan, scheduler, graphs
        self._warm_up_samplers()
        self._next_request_id = 0
        # Seeds of requests that gave none: drawn from one stream that every rank of a
        # tensor-parallel engine starts from rank 0's value, so the ranks agree on them.
        self._seed_rng = (None if not self._tp.enabled
                          else random.Random(self._tp.broadcast_object(draw_seed())))
        self._requests_by_id: dict[int, Request] = {}  # a spawned rank's requests (apply_command)
        self._held = HeldSamples()  # samples 1.. of a prompt, until sample 0 has prefilled
        self._grammars: LazyCompiler | None = None  # structured outputs' compiler
        self.num_steps = 0  # engine steps run (prefill and decode)
        self._sampling_cache: tuple[tuple[int, ...], SamplingTensors] | None = None
        self._pending = None  # the step queued ahead of the host (async_scheduling)
        self._host_buffers = None

    # ----------------------------------------------------------------- the step loop

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that finished in it (none when nothing
        is queued).

        The step's decodes run first: with speculation one propose / verify over them (a
        captured graph on CUDA), then the prefill chunks in a forward of their own; without,
        decodes and prefill chunks share one forward (only a step of decodes alone replays
        the captured decode graph)."""
        for request in self._held.release():
            self._queue(request)
        if not self.scheduler.has_unfinished and self._pending is None:
            return []
        if self._workers is None:
            return self._step()
        self._workers.step()
        try:
            finished = self._step()
        except Exception as e:
            failure = self._workers.failure_after_error()
            if failure is not None:
                raise workers.WorkerDied(failure) from e
            raise
        self._workers.step_done()
        return finished

    # ----------------------------------------------------------------- public API

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (see ``verispec.engine.inputs``).

        ``sampling_params``: one for all prompts, or one per prompt (None = defaults). Returns one
        RequestOutput per prompt, in order. An invalid request in a list gets
        ``finish_reason="error"`` and its ``error`` message while the others run; a single
        invalid prompt raises ValueError.
        """
        single = inputs.is_single_prompt(prompts)
        if single:
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise ValueError(
                "prompts must be a string, a list of token ids, a list of chat messages, a "
                f"prompt dict or a list of those, got {type(prompts).__name__}"
            )
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {len(prompts)} "
                    "prompts; give one, or one per prompt"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)

        outputs: list[RequestOutput | None] = [None] * len(prompts)
        requests: list[tuple[int, Request]] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                requests.append((i, self._make_request(prompt, params, several=True)))
            except ValueError as e:
                if single:
                    raise
                outputs[i] = RequestOutput(
                    request_id=-1, prompt=inputs.prompt_text(prompt),
                    prompt_token_ids=[], finish_reason="error", error=f"prompt {i}: {e}",
                )
        for _, request in requests:
            self._queue_samples(request)
        try:
            while self.has_unfinished_requests:
                self.step()
        except BaseException:  # e.g. KeyboardInterrupt: leave the engine clean for the next call
            self._abort([s for _, r in requests for s in r.samples or [r]])
            raise
        for i, request in requests:
            outputs[i] = self._output(request)
        return outputs  # type: ignore[return-value]

    def get_metrics(self) -> dict:
        """Aggregate metrics since start-up: speculative decoding counters and rates with vLLM's
        definitions (docs/design.md §8) under ``"spec_decoding"`` (None without speculation);
        the prefix cache's prompt tokens looked up and found under ``"prefix_cache"`` (None
        with it off)."""
        cache = self.scheduler.prefix_cache
        return {"spec_decoding": None if self.spec is None else self.spec.stats.to_dict(),
                "prefix_cache": None if cache is None else
                {"queries": cache.num_queries, "hits": cache.num_hits}}

    def reset_prefix_cache(self) -> None:
        """Forget every published KV block (the next requests compute their prompts cold)."""
        self.runner.kv_cache.pool.reset_prefix_cache()
        if self._workers is not None:
            self._workers.queue(("reset",))

    def spec_decoding_log_line(self, elapsed_s: float) -> str | None:
        """The vLLM-format metrics line over all steps so far (None without speculation)."""
        return None if self.spec is None else self.spec.stats.log_line(elapsed_s)

    # ----------------------------------------------------------------- driving the engine
    # For a caller that runs the step loop itself (the server: one engine thread adds requests,
    # steps, and aborts between steps). Not thread-safe: call from one thread only.

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                    after: Request | None = None) -> Request:
        """Validate and queue one request (ValueError naming the cause on bad input); it joins
        the batch at the next ``step`` with a free slot and KV blocks for it. Read it with
        ``get_output``. ``after``: a request of the same prompt; with the prefix cache on this
        one waits until ``after`` has computed the prompt, then reuses its blocks (the samples
        of one prompt, ``engine.samples``)."""
        request = self._make_request(prompt, sampling_params or SamplingParams())
        if after is not None and self.scheduler.prefix_cache is not None:
            self._held.hold(after, request)
        else:
            self._queue(request)
        return request

    def abort_request(self, request: Request) -> None:
        """Drop an unfinished request, waiting or running; its slot and KV blocks are free for the
        next step and its ``finish_reason`` is ``"abort"`` (a finished request is left as it is)."""
        self._abort([request])

    def get_output(self, request: Request) -> RequestOutput:
        """The request's output so far (final once ``finish_reason`` is set)."""
        return self._output(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._held) or self._pending is not None

    def generate_stream(
        self, prompt: Any, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding the cumulative RequestOutput after every step that
        added text (the last one has ``finish_reason`` set). Raises ValueError on bad input at
        the call, before the first ``next``."""
        request = self._make_request(prompt, sampling_params or SamplingParams())
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[RequestOutput]:
        self._queue(request)  # at the first next(): an unread stream queues nothing
        shown = ""
        try:
            while True:
                # Another stream's step or a generate() call may have run (and finished) this
                # request since the last yield: step only while it runs, and always end with
                # its final output.
                if not request.finished:
                    self.step()
                output = self._output(request)
                if request.finished:
                    yield output
                    return
                if output.text != shown:
                    shown = output.text
                    yield output
        finally:  # the consumer may stop early: release the request's slot
            self._abort([request])

    def apply_command(self, command: tuple) -> None:
        """On a spawned rank of a tensor-parallel engine: apply one of rank 0's state changes
        (``runtime.workers``) so the next step schedules what rank 0's does."""
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, ids, params, seed = command
            request = self._new_request(request_id, prompt, list(ids), params, seed)
            self._requests_by_id[request_id] = request
            self.scheduler.add(request)
        elif kind == "abort":
            request = self._requests_by_id.pop(command[1], None)
            if request is not None:
                self._abort([request])
        elif kind == "reset":
            self.reset_prefix_cache()
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        for request_id in [i for i, r in self._requests_by_id.items() if r.finished]:
            del self._requests_by_id[request_id]

    def close(self) -> None:
        """Stop the ranks this engine spawned (tensor parallelism; no-op otherwise). Also runs
        at exit; the engine cannot step after it."""
        group = getattr(self, "_workers", None)
        if group is not None:
            self.drop_graphs()
            group.close()
            self._workers = None

    def drop_graphs(self) -> None:
        """Free the captured steps (target and proposer), before a rank leaves its process
        group: a graph holds the NCCL collectives it captured, and NCCL's teardown is not to
        run under live graphs of its communicator."""
        runners = [getattr(self, "runner", None)]
        if getattr(self, "spec", None) is not None:
            runners.append(self.spec.proposer.runner)
        for runner in runners:
            if runner is not None:
                runner.graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _abort(self, requests: Sequence[Request]) -> None:
        for request in requests:
            if not request.finished:
                if self._workers is not None:
                    self._workers.queue(("abort", request.request_id))
                if request.slot >= 0 and self.spec is not None:
                    self.spec.release(request)
                self.scheduler.abort(request)
                request.finish_reason = "abort"
                request.metrics.finished_time = time.perf_counter()
