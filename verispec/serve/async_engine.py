"""The async front over the engine: one engine thread steps ``LLM``, HTTP handlers submit and read.

The engine (``LLM``: scheduler, KV cache, proposer, its tokenizer) is touched by the engine thread
only. Handlers on the asyncio event loop send it commands (add, abort) through a thread-safe
queue; it answers each submission on the submission's asyncio queue
(``loop.call_soon_threadsafe``). One turn of the engine thread:

    take the commands (block while no request is queued or running)
    add / abort requests        <- between steps: requests join and leave the batch here
    step                        <- continuous batching, speculative or not, as LLM.generate
    deliver each request's output so far; observe the metrics

A request waits in the scheduler's queue while every slot or the KV pool is taken: a full server
queues, it does not refuse. A client that goes away aborts its requests: the abort frees its KV
blocks before the next step. Torch releases the GIL inside its kernels, so the event loop keeps
serving HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from verispec.engine.llm import LLM
from verispec.engine.request import Request, RequestOutput
from verispec.sampling_params import SamplingParams
from verispec.serve.metrics import ServerMetrics

logger = logging.getLogger("verispec.serve")

_ADMITTED = object()  # the engine thread's answer to a submission it queued


class EngineError(RuntimeError):
    """The engine failed on a step or is shutting down: the request cannot complete."""


class Submission:
    """The requests of one API call (one per prompt) and the queue their outputs arrive on.

    Items on the queue: ``_ADMITTED``, an exception (the submission failed), or
    ``(index, output)`` with the cumulative ``RequestOutput`` of prompt ``index``.
    """

    def __init__(self, engine: AsyncEngine, num_requests: int) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival_time = time.perf_counter()
        self._finished = [False] * num_requests
        self._aborted = False

    @property
    def finished(self) -> bool:
        return all(self._finished)

    async def outputs(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Until every request finished: the newest output of each request that moved, in
        prompt order. Outputs are cumulative, so a slow reader skips stale ones."""
        while not self.finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            latest: dict[int, RequestOutput] = {}
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                index, output = item
                latest[index] = output
                self._finished[index] = output.finished
            yield sorted(latest.items())

    def abort(self) -> None:
        """Abort the requests that have not finished (no-op once all finished or aborted)."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self.engine._commands.put(("abort", self))

    def post(self, item) -> None:
        """From the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is reading any more
            pass


@dataclass
class _Tracked:
    """A request the engine thread runs for a submission (engine thread only)."""

    submission: Submission
    index: int
    request: Request
    num_delivered: int = 0  # output tokens delivered so far
    last_delivery_time: float = 0.0


class AsyncEngine:
    """Owns the engine thread of ``llm``; ``start`` it before ``submit``, ``shutdown`` at the
    end."""

    def __init__(self, llm: LLM, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._tracked: list[_Tracked] = []
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread after its current step; unfinished requests get an
        EngineError."""
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, prompts: Sequence[list[int]],
                     params: Sequence[SamplingParams]) -> Submission:
        """Queue one request per prompt (all or none: a ValueError from the engine names the
        bad input); returns once the engine thread took them."""
        if not self.is_running:
            raise EngineError("the engine is not running")
        submission = Submission(self, len(prompts))
        self._commands.put(("add", (submission, list(prompts), list(params))))
        try:
            item = await submission.queue.get()
        except asyncio.CancelledError:  # the client left while the engine was busy
            submission.abort()
            raise
        if isinstance(item, BaseException):
            raise item
        return submission

    # ----------------------------------------------------------------- engine thread

    def _run(self) -> None:
        while True:
            try:
                for kind, payload in self._take_commands():
                    if kind == "stop":
                        self._fail_all(EngineError("the server is shutting down"))
                        return
                    if kind == "add":
                        self._add(*payload)
                    else:
                        self._abort(payload)
                if self.llm.has_unfinished_requests:
                    self.llm.step()
                    self._deliver()
            except Exception as e:  # a bug or a device failure: fail what runs, keep serving
                logger.exception("engine step failed")
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            self._update_gauges()

    def _take_commands(self) -> list[tuple[str, object]]:
        """The commands queued so far; waits for one while the engine has nothing to run."""
        commands = []
        if not self.llm.has_unfinished_requests:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, submission: Submission, prompts: list[list[int]],
             params: list[SamplingParams]) -> None:
        requests: list[Request] = []
        try:
            for prompt, p in zip(prompts, params):
                requests.append(self.llm.add_request(prompt, p))
        except ValueError as e:
            for request in requests:
                self.llm.abort_request(request)
            submission.post(e)
            return
        self._tracked += [_Tracked(submission, i, r) for i, r in enumerate(requests)]
        submission.post(_ADMITTED)

    def _abort(self, submission: Submission) -> None:
        for tracked in [t for t in self._tracked if t.submission is submission]:
            self.llm.abort_request(tracked.request)  # frees its slot and KV blocks now
            self.metrics.request_success["abort"].inc()
            self._tracked.remove(tracked)

    def _deliver(self) -> None:
        """After a step: each request that moved gets its output so far; metrics observed."""
        now = time.perf_counter()
        metrics = self.metrics
        for tracked in list(self._tracked):
            request, submission = tracked.request, tracked.submission
            num_new = request.num_output_tokens - tracked.num_delivered
            if not num_new and not request.finished:
                continue
            if num_new:
                if tracked.num_delivered == 0:
                    metrics.time_to_first_token.observe(now - submission.arrival_time)
                    metrics.prompt_tokens.inc(request.num_prompt_tokens)
                else:
                    metrics.inter_token_latency.observe(now - tracked.last_delivery_time)
                metrics.generation_tokens.inc(num_new)
                tracked.num_delivered = request.num_output_tokens
                tracked.last_delivery_time = now
            if request.finished:
                metrics.e2e_request_latency.observe(now - submission.arrival_time)
                metrics.request_success[request.finish_reason].inc()
                self._tracked.remove(tracked)
            submission.post((tracked.index, self.llm.get_output(request)))
        if self.llm.spec is not None:
            metrics.observe_spec(self.llm.spec.stats)

    def _fail_all(self, error: EngineError) -> None:
        for tracked in self._tracked:
            try:
                self.llm.abort_request(tracked.request)
            except Exception:  # the engine is already broken; the error below says so
                logger.exception("abort after an engine failure")
            tracked.submission.post(error)
        self._tracked.clear()

    def _update_gauges(self) -> None:
        scheduler = self.llm.scheduler
        self.metrics.set_queue(len(scheduler.running), len(scheduler.waiting),
                               self.llm.max_num_seqs - scheduler.num_free_slots,
                               scheduler.kv_cache_usage, scheduler.num_preemptions)
