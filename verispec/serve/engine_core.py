"""The server's engine process: one ``LLM`` and its step loop, driven over the channel.

``run_engine_core`` is the process's entry point (started with the ``spawn`` method by
``verispec.serve.async_engine``): it loads the model, answers ``EngineReady`` (or
``EngineStartFailed``), then runs ``EngineCore.run`` until told to shut down or until the API
process goes away (the channel's end). This process owns the device; the API process never
touches it. One turn of the loop:

    take the commands that arrived (block while no request is queued or running)
    add / abort requests            <- between steps: requests join and leave the batch here
    step                            <- continuous batching, speculative or not, as LLM.generate
    send one EngineOutputs          <- each moved request's new tokens, not its whole output

Nothing Python-heavy that can live elsewhere runs here: requests arrive tokenized, and the API
process turns tokens into text, checks stop strings (requests arrive without them; the API
process aborts a request once its text holds one) and serves HTTP. A step that raises ends the
requests it ran with an error and the loop goes on; SIGINT is ignored (a terminal's Ctrl-C
reaches the whole process group: the API process shuts this one down in order). The process
runs at a lower CPU priority than the API process (``ENGINE_NICENESS``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import traceback
from dataclasses import dataclass

from verispec.engine.llm import LLM
from verispec.engine.request import Request
from verispec.serve.channel import (
    AbortRequests,
    AddRequests,
    EngineInfo,
    EngineOutputs,
    EngineReady,
    EngineStartFailed,
    FrameSocket,
    RequestDelta,
    SchedulerStats,
    Shutdown,
)

logger = logging.getLogger("verispec.serve")

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
# The engine process yields the CPU to the API process when both want it (a CPU server whose
# engine keeps every core busy): the API process's work is bounded by the tokens the engine
# makes and the requests that arrive, and it is what clients and health checks wait on. On a
# GPU host with cores to spare it changes nothing (benchmarks/bench_server_robustness.py measures
# /health under load).
ENGINE_NICENESS = 10


@dataclass
class _Tracked:
    """A request of the engine and how much of its output the API process has."""

    request: Request
    num_sent: int = 0  # output tokens sent so far


class EngineCore:
    """Applies the API process's commands to ``llm`` between steps; reports each step."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tracked: dict[int, _Tracked] = {}  # API request id -> its engine request

    def run(self, channel: FrameSocket) -> None:
        """Until Shutdown or the channel's end."""
        llm = self.llm
        while True:
            try:
                commands = channel.receive(None if not llm.has_unfinished_requests else 0.0)
            except EOFError:  # the API process is gone: nobody to serve
                return
            accepted: list[int] = []
            refused: list[tuple[int, str, str]] = []
            for command in commands:
                if isinstance(command, Shutdown):
                    return
                if isinstance(command, AddRequests):
                    self._add(command, accepted, refused)
                elif isinstance(command, AbortRequests):
                    self._abort(command.request_ids)
            deltas: list[RequestDelta] = []
            failed = None
            stepped = llm.has_unfinished_requests
            if stepped:
                try:
                    llm.step()
                    deltas = self._deltas()
                except Exception as e:  # a bug or a device failure: fail what runs, go on
                    logger.exception("engine step failed")
                    failed = (self._abort(list(self.tracked)),
                              f"the engine failed: {type(e).__name__}: {e}")
            if commands or stepped:
                try:
                    channel.send(EngineOutputs(accepted, refused, deltas, failed, self._stats(),
                                               None if llm.spec is None else llm.spec.stats))
                except OSError:  # the API process is gone
                    return

    def _add(self, command: AddRequests, accepted: list[int],
             refused: list[tuple[int, str, str]]) -> None:
        """All the requests of one API call, or none (the error's type and message go back)."""
        added: list[tuple[int, Request]] = []
        try:
            first, first_prompt = None, None
            for request_id, prompt, params in zip(command.request_ids, command.prompts,
                                                  command.params):
                # the samples of one prompt (n > 1) follow each other: the later ones reuse
                # the first one's prompt blocks
                if prompt != first_prompt:
                    first, first_prompt = None, prompt
                request = self.llm.add_request(prompt, params, after=first)
                first = first or request
                added.append((request_id, request))
        except Exception as e:  # ValueError: bad input; anything else is a bug, logged here
            if not isinstance(e, ValueError):
                logger.exception("adding requests failed")
            for _, request in added:
                self.llm.abort_request(request)
            refused.append((command.batch_id, type(e).__name__, str(e)))
            return
        for request_id, request in added:
            self.tracked[request_id] = _Tracked(request)
        accepted.append(command.batch_id)

    def _abort(self, request_ids: list[int]) -> list[int]:
        """Drop the requests (their slots and KV blocks are free for the next step); the ids
        that were still here."""
        dropped = []
        for request_id in request_ids:
            tracked = self.tracked.pop(request_id, None)
            if tracked is None:  # finished (or aborted) before the command arrived
                continue
            try:
                self.llm.abort_request(tracked.request)
            except Exception:  # after a failed step the engine may be broken; say so once
                logger.exception("abort after an engine failure")
            dropped.append(request_id)
        return dropped

    def _deltas(self) -> list[RequestDelta]:
        """The new output of every request that moved in the step; finished ones leave."""
        deltas = []
        for request_id, tracked in list(self.tracked.items()):
            request = tracked.request
            num_tokens = request.num_output_tokens
            if num_tokens == tracked.num_sent and not request.finished:
                continue
            start = tracked.num_sent
            token_ids = ([request.last_token_id] if num_tokens == start + 1
                         else request.output_token_ids[start:num_tokens].tolist())
            logprobs = None if request.logprobs is None else request.logprobs[start:num_tokens]
            prompt_logprobs = None if start else request.prompt_logprobs
            deltas.append((request_id, token_ids, logprobs, request.finish_reason,
                           request.num_cached_tokens, prompt_logprobs))
            tracked.num_sent = num_tokens
            if request.finished:
                del self.tracked[request_id]
        return deltas

    def _stats(self) -> SchedulerStats:
        scheduler = self.llm.scheduler
        cache = scheduler.prefix_cache
        return SchedulerStats(len(scheduler.running), len(scheduler.waiting),
                              self.llm.max_num_seqs - scheduler.num_free_slots,
                              scheduler.kv_cache_usage, scheduler.num_preemptions,
                              0 if cache is None else cache.num_queries,
                              0 if cache is None else cache.num_hits)


def engine_info(llm: LLM) -> EngineInfo:
    spec = llm.speculative_config
    speculation = "no speculation" if spec is None else (
        f"speculation {spec.method}, k={spec.num_speculative_tokens}")
    return EngineInfo(
        max_num_seqs=llm.max_num_seqs, max_model_len=llm.max_model_len,
        vocab_size=llm.model_config.vocab_size, eos_token_ids=llm.eos_token_ids,
        num_speculative_tokens=llm.num_speculative_tokens, tokenizer=llm.tokenizer,
        description=f"{str(llm.runner.dtype).removeprefix('torch.')}, {speculation}")


def run_engine_core(engine_kwargs: dict, sock: socket.socket) -> None:
    """The engine process: ``LLM(**engine_kwargs)``, then serve the API process on ``sock``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(ENGINE_NICENESS)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # a spawned process has none
    channel = FrameSocket(sock)
    try:
        llm = LLM(**engine_kwargs)
    except Exception as e:
        channel.send(EngineStartFailed(type(e).__name__, str(e), traceback.format_exc()))
        channel.close()
        return
    channel.send(EngineReady(engine_info(llm)))
    try:
        EngineCore(llm).run(channel)
    finally:
        channel.close()
        llm.close()
