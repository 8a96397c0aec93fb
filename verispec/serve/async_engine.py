"""The API process's side of the engine: the engine process, its channel, the requests in flight.

The engine (``LLM``, its scheduler, KV cache, proposer and device) lives in a process of its own
(``verispec.serve.engine_core``, started with the ``spawn`` method: this process never touches
the device), so the step loop and the HTTP side never share a GIL. ``AsyncEngine.start`` starts
it and waits until the model is loaded (a bad argument is a ValueError here, before the server
listens); ``connect`` attaches the channel (``verispec.serve.channel``) to the event loop, where
one task reads the engine's ``EngineOutputs``, one per step:

    admitted / refused API calls  -> their ``submit`` returns / raises
    each request's new tokens     -> its RequestState (committed at once, or after the stop
                                     strings are checked); its reader woken when it must look
    a failed step                 -> its requests' readers get an EngineError
    scheduler gauges, speculative counters -> the Prometheus metrics

Readers (``Submission.outputs``) do the Python-heavy part on their own turn: stop strings and
text (``verispec.serve.detokenizer``), the response. A streamed request is looked at every step
it moved; a non-streamed one without stop strings only when it finished. A slow reader skips to
the newest output. A request waits in the engine's queue while every slot or the KV pool is
taken: a full server queues, it does not refuse. A client that goes away aborts its requests:
the abort frees their KV blocks before the engine's next step.

Request metrics are observed here: time to first token and inter-token latency when the
engine's tokens arrive, token counts when tokens are committed, end-to-end latency and the
finish reason when a request finishes. An engine process that dies is seen at once (the channel
ends): every pending request gets an EngineError, ``is_running`` turns False (``/health`` 503)
and new requests are refused with 503. ``close`` stops the engine process and waits for it
(terminated, then killed, if it does not exit): no process outlives the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Sequence

from verispec.sampling_params import SamplingParams
from verispec.serve.channel import (
    AbortRequests,
    AddRequests,
    EngineInfo,
    EngineOutputs,
    EngineStartFailed,
    FrameSocket,
    Shutdown,
    encode,
    read_frame,
    socket_pair,
)
from verispec.serve.detokenizer import Output, RequestState, decodes_incrementally
from verispec.serve.engine_core import run_engine_core
from verispec.serve.metrics import ServerMetrics

logger = logging.getLogger("verispec.serve")

STOP_TIMEOUT_S = 30.0  # the engine's current step ends within this, or it is terminated
READ_LIMIT_BYTES = 4 << 20  # the channel reader's buffer (asyncio's default is 64 KiB)


class EngineError(RuntimeError):
    """The engine failed on a step, died or is shutting down: the request cannot complete."""


class Submission:
    """The requests of one API call (one per prompt) and their reader's view of them."""

    def __init__(self, engine: AsyncEngine, states: list[RequestState], stream: bool) -> None:
        self.engine = engine
        self.states = states
        self.stream = stream
        self.arrival_time = time.perf_counter()
        self._woken = asyncio.Event()
        self._admitted = asyncio.Event()
        self._error: BaseException | None = None
        self._aborted = False

    @property
    def finished(self) -> bool:
        return all(state.finished for state in self.states)

    def wake(self) -> None:
        self._woken.set()

    def admit(self) -> None:
        """The engine took its requests: ``admitted`` returns."""
        self._admitted.set()

    def fail(self, error: BaseException) -> None:
        """End it with ``error`` (raised to its reader); its requests are gone from the engine
        or about to be."""
        if self._error is None:
            self._error = error
        for state in self.states:
            state.end("error")
        self._admitted.set()
        self._woken.set()

    async def admitted(self) -> None:
        await self._admitted.wait()
        if self._error is not None:
            raise self._error

    async def outputs(self) -> AsyncIterator[list[tuple[int, RequestState, Output]]]:
        """Until every request finished and was shown: (index, state, output) of each request
        with something new, in prompt order (streamed: whenever one moved; otherwise: as they
        finish). A request may have finished before its reader first looks."""
        while True:
            if self._error is not None:
                raise self._error
            now = time.perf_counter()
            moved = []
            for index, state in enumerate(self.states):
                if state.params.stop and not state.finished:
                    self.engine.committed(state, self, state.commit_stop_strings(), now)
                if state.changed and (self.stream or state.finished):
                    moved.append((index, state, state.output()))
            if moved:
                yield moved
            elif self.finished:
                return
            else:
                await self._woken.wait()
                self._woken.clear()

    def abort(self) -> None:
        """Abort the requests that have not finished (no-op once all finished or aborted)."""
        if self._aborted:
            return
        self._aborted = True
        running = [state for state in self.states if not state.finished]
        for state in running:
            state.end("abort")
            self.engine.metrics.request_success["abort"].inc()
        self.engine.abort([state.request_id for state in running])


class AsyncEngine:
    """The engine process of a server. ``start`` it (blocks while the model loads), ``connect``
    it in the event loop, ``submit`` requests, ``close`` it at the end."""

    def __init__(self, engine_kwargs: dict) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        self.info: EngineInfo | None = None
        self.metrics: ServerMetrics | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self._frames: FrameSocket | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task | None = None
        self._incremental = False
        self._requests: dict[int, tuple[RequestState, Submission]] = {}  # in the engine
        self._unadmitted: dict[int, Submission] = {}  # batch id -> API call not yet answered
        self._next_request_id = 0
        self._next_batch_id = 0
        self._dead: EngineError | None = None
        self._closing = False

    # ----------------------------------------------------------------- life cycle

    def start(self, timeout_s: float | None = None) -> EngineInfo:
        """Start the engine process and wait (up to ``timeout_s``; None: as long as it takes)
        until its model is loaded. A ValueError of ``LLM``'s is raised as such."""
        context = multiprocessing.get_context("spawn")
        api_end, engine_end = socket_pair()
        # A daemonic process may not start processes: a tensor-parallel engine's does (its
        # ranks); it stops them itself when it ends (LLM.close).
        daemon = self.engine_kwargs.get("tensor_parallel_size", 1) == 1
        self.process = context.Process(target=run_engine_core, name="verispec-engine",
                                       args=(self.engine_kwargs, engine_end), daemon=daemon)
        self.process.start()
        engine_end.close()  # the child has its own copy; ours would hide its end from us
        self._frames = FrameSocket(api_end)
        try:
            messages = self._frames.receive(timeout_s)
        except EOFError:
            messages = []
        if not messages or isinstance(messages[0], EngineStartFailed):
            timed_out = not messages and self.process.is_alive()
            self._stop_process(0.0 if messages or timed_out else 5.0)
            self._frames.close()
            if timed_out:
                raise RuntimeError(f"the engine process did not load its model in {timeout_s} s")
            if not messages:
                raise RuntimeError(f"the engine process exited (exit code "
                                   f"{self.process.exitcode}) before its model was loaded; its "
                                   "log above says why")
            failed = messages[0]
            if failed.error_type == "ValueError":
                raise ValueError(failed.message)
            raise RuntimeError(f"the engine process failed to start: {failed.error_type}: "
                               f"{failed.message}\n{failed.traceback}")
        self.info = messages[0].info
        self._incremental = decodes_incrementally(self.info.tokenizer)
        return self.info

    async def connect(self, metrics: ServerMetrics) -> None:
        """Attach the channel to the running event loop (the server's start-up)."""
        self.metrics = metrics
        sock, leftover = self._frames.detach()
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=sock, limit=READ_LIMIT_BYTES)
        if leftover:
            self._reader.feed_data(leftover)
        self._read_task = asyncio.ensure_future(self._read_loop())

    async def close(self) -> None:
        """Stop the engine process after its current step (the server's shut-down);
        unfinished requests get an EngineError."""
        if self._writer is None:  # never connected
            self.shutdown()
            return
        self._closing = True
        self._fail_all(EngineError("the server is shutting down"))
        self._send(Shutdown())
        # Off the event loop: the read task keeps draining the channel while the engine ends
        # its step, so the engine never waits on a full socket buffer.
        await asyncio.get_running_loop().run_in_executor(None, self._stop_process,
                                                         STOP_TIMEOUT_S)
        if self._read_task is not None:
            self._read_task.cancel()
            await asyncio.gather(self._read_task, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()

    def shutdown(self) -> None:
        """Stop the engine process from outside an event loop: one started but never
        connected, or one whose server ended without its shut-down (no-op after ``close``)."""
        if self.process is None or (self._closing and not self.process.is_alive()):
            return
        self._closing = True
        if self._writer is None:
            try:
                self._frames.send(Shutdown())
            except OSError:
                pass
            self._stop_process(STOP_TIMEOUT_S)
            self._frames.close()
        else:  # its channel belongs to an event loop that is gone
            self._stop_process(0.0)

    def _stop_process(self, timeout_s: float) -> None:
        process = self.process
        process.join(timeout_s)
        if process.is_alive():
            if timeout_s:
                logger.warning("the engine process did not stop in %.0f s; terminating it",
                               timeout_s)
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()

    @property
    def is_running(self) -> bool:
        return (self._writer is not None and self._dead is None and not self._closing
                and self.process.is_alive())

    # ----------------------------------------------------------------- requests

    async def submit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                     stream: bool = False) -> Submission:
        """Queue one request per prompt (all or none: a ValueError from the engine names the
        bad input); returns once the engine took them."""
        if not self.is_running:
            raise self._dead or EngineError("the engine is not running")
        info = self.info
        states = []
        for prompt, p in zip(prompts, params):
            states.append(RequestState(self._next_request_id, p, len(prompt), info.tokenizer,
                                       self._incremental, stream))
            self._next_request_id += 1
        submission = Submission(self, states, stream)
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._unadmitted[batch_id] = submission
        for state in states:
            self._requests[state.request_id] = (state, submission)
        # Stop strings are this process's to check (verispec.serve.detokenizer).
        engine_params = [dataclasses.replace(p, stop=()) if p.stop else p for p in params]
        self._send(AddRequests(batch_id, [s.request_id for s in states],
                               [list(p) for p in prompts], engine_params))
        try:
            await submission.admitted()
        except asyncio.CancelledError:  # the client left while the engine was busy
            self._unadmitted.pop(batch_id, None)
            submission.abort()
            raise
        return submission

    def abort(self, request_ids: list[int]) -> None:
        """Drop the requests from the engine (those it already finished are ignored)."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
        if request_ids:
            self._send(AbortRequests(request_ids))

    def committed(self, state: RequestState, submission: Submission, num_new: int,
                  now: float) -> None:
        """Metrics of ``num_new`` tokens just committed; a request that just stopped on a stop
        string leaves the engine."""
        metrics = self.metrics
        if num_new:
            if state.num_tokens == num_new:
                metrics.prompt_tokens.inc(state.num_prompt_tokens)
            metrics.generation_tokens.inc(num_new)
        if state.finished and not state.finish_observed:
            state.finish_observed = True
            metrics.e2e_request_latency.observe(now - submission.arrival_time)
            metrics.request_success[state.finish_reason].inc()
            if state.engine_finish_reason is None:  # a stop string: the engine runs on
                self.abort([state.request_id])

    def _send(self, message) -> None:
        if self._writer is not None and self._dead is None and not self._writer.is_closing():
            self._writer.write(encode(message))

    # ----------------------------------------------------------------- the engine's outputs

    async def _read_loop(self) -> None:
        while True:
            try:
                outputs = await read_frame(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                if not self._closing:
                    self._engine_died()
                return
            try:
                self._on_outputs(outputs)
            except Exception:  # a bug here: fail what is in flight, keep serving
                logger.exception("the engine's outputs could not be processed")
                self.abort(list(self._requests))
                self._fail_all(EngineError("the server failed to process the engine's "
                                           "outputs"))

    def _on_outputs(self, outputs: EngineOutputs) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        for batch_id in outputs.accepted:
            submission = self._unadmitted.pop(batch_id, None)
            if submission is not None:
                submission.admit()
        for batch_id, error_type, message in outputs.refused:
            submission = self._unadmitted.pop(batch_id, None)
            if submission is not None:
                for state in submission.states:
                    self._requests.pop(state.request_id, None)
                submission.fail(ValueError(message) if error_type == "ValueError" else
                                EngineError(f"the engine failed: {error_type}: {message}"))
        for request_id, token_ids, logprobs, finish_reason, num_cached, prompt_logprobs in (
                outputs.deltas):
            entry = self._requests.get(request_id)
            if entry is None:  # aborted, or stopped here on a stop string
                continue
            state, submission = entry
            if token_ids:
                if state.last_token_time == 0.0:
                    metrics.time_to_first_token.observe(now - submission.arrival_time)
                else:
                    metrics.inter_token_latency.observe(now - state.last_token_time)
                state.last_token_time = now
            if prompt_logprobs is not None:
                state.prompt_logprobs = prompt_logprobs
            num_new = state.receive(token_ids, logprobs, finish_reason, num_cached)
            self.committed(state, submission, num_new, now)
            if finish_reason is not None:
                self._requests.pop(request_id, None)
            if state.wakes_each_step or state.finished:
                submission.wake()
        if outputs.failed is not None:
            request_ids, message = outputs.failed
            for request_id in request_ids:
                entry = self._requests.pop(request_id, None)
                if entry is not None:
                    entry[1].fail(EngineError(message))
        metrics.set_queue(*outputs.stats)
        if outputs.spec_stats is not None:
            metrics.observe_spec(outputs.spec_stats)

    def _engine_died(self) -> None:
        self.process.join(1.0)  # it closed the channel by exiting: its exit code is near
        if self.process.is_alive():  # it closed the channel and lives on: not ours to trust
            self.process.kill()
            self.process.join()
        self._dead = EngineError(f"the engine process died (exit code {self.process.exitcode})")
        logger.error("%s; failing %d pending request(s); /health now answers 503", self._dead,
                     len(self._requests) + sum(len(s.states) for s in self._unadmitted.values()))
        self._fail_all(self._dead)

    def _fail_all(self, error: EngineError) -> None:
        for _, submission in list(self._requests.values()):
            submission.fail(error)
        for submission in self._unadmitted.values():
            submission.fail(error)
        self._requests.clear()
        self._unadmitted.clear()
