"""The channel between the server's API process and its engine process, and what crosses it.

One Unix stream socket pair (``socket.socketpair``), one end in each process. A frame is an
8-byte big-endian payload length, then the payload: one message, ``pickle``d (protocol 5). The
engine process reads and writes its end with blocking calls between steps (``FrameSocket``); the
API process reads its end on the asyncio event loop (``read_frame``) and writes through the
loop's transport, so neither a large frame nor a slow engine ever blocks an HTTP handler.
Pickle is safe here: both ends are this program, started together, and the socket pair is
reachable by no one else.

Messages, API process -> engine process:
    AddRequests     the requests of one API call, all or none (answered in EngineOutputs)
    AbortRequests   requests to drop before the next step (a client left, or the API process
                    found a stop string)
    Shutdown        finish: the engine process exits after its current step

Engine process -> API process:
    EngineReady / EngineStartFailed   once, when the model is loaded (or failed to load)
    EngineOutputs   one per turn of the engine's loop that ran a step or took commands: the
                    new output tokens of every request that moved (``RequestDelta``: deltas,
                    never the cumulative output), finish reasons, logprobs, the API calls
                    admitted or refused, requests a failed step ended, and the scheduler's
                    gauges and speculative counters.
"""

from __future__ import annotations

import asyncio
import pickle
import selectors
import socket
import struct
from typing import Any, NamedTuple

from verispec.engine.metrics import SpecDecodingStats
from verispec.sampling_params import SamplingParams

HEADER = struct.Struct("!Q")
# Kernel buffer per direction: a step's frame (hundreds of deltas, with logprobs) fits whole,
# so the engine's send returns before the API process has read it.
SOCKET_BUFFER_BYTES = 4 << 20
READ_BYTES = 256 << 10  # one recv's most


# ----------------------------------------------------------------------------- messages


class AddRequests(NamedTuple):
    batch_id: int  # the API call; EngineOutputs.accepted / refused name it
    request_ids: list[int]  # chosen by the API process, unique for the server's life
    prompts: list[list[int]]  # token ids, one prompt per request
    params: list[SamplingParams]  # without stop strings: the API process checks those


class AbortRequests(NamedTuple):
    request_ids: list[int]


class Shutdown(NamedTuple):
    pass


class EngineInfo(NamedTuple):
    """What the API process needs to know of the engine it talks to."""

    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int  # k, 0 without speculation
    tokenizer: Any  # the engine's own tokenizer (pickled across), None if the model has none
    description: str  # dtype and speculation, for the start-up log line


class EngineReady(NamedTuple):
    info: EngineInfo


class EngineStartFailed(NamedTuple):
    error_type: str  # "ValueError": a bad argument, re-raised as such in the API process
    message: str
    traceback: str


# What one request did in one step, a plain tuple (pickled in C: a NamedTuple per request
# would cost ~7x more to pickle, hundreds of times a step):
#   (request_id,
#    token_ids,          output tokens new since the last delta (several with speculation)
#    logprobs,           one dict per new token (token id -> logprob), or None if not asked
#    finish_reason,      "stop" (EOS or a stop token id: the last token), "length" or None
#    num_cached_tokens,  prompt tokens served from the prefix cache
#    prompt_logprobs)    with the first delta of a request that asked for them (None first,
#                        then one dict per prompt token), else None
RequestDelta = tuple[int, list[int], "list[dict[int, float]] | None", "str | None", int,
                     "list[dict[int, float] | None] | None"]


class SchedulerStats(NamedTuple):
    num_running: int
    num_waiting: int
    num_slots_in_use: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_preemptions: int  # running count since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which found


class EngineOutputs(NamedTuple):
    accepted: list[int]  # batch ids of AddRequests admitted this turn
    refused: list[tuple[int, str, str]]  # (batch id, error type, message): ValueError = bad input
    deltas: list[RequestDelta]
    failed: tuple[list[int], str] | None  # a step raised: the requests it ended, and why
    stats: SchedulerStats
    spec_stats: SpecDecodingStats | None  # running totals (None without speculation)


# ----------------------------------------------------------------------------- frames


def encode(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=5)
    return HEADER.pack(len(payload)) + payload


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(the API process's end, the engine process's end)."""
    api_end, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (api_end, engine_end):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return api_end, engine_end


class FrameSocket:
    """Blocking frames over a socket: the engine process's end (and the API process's until the
    engine is ready). ``receive`` raises EOFError once the other end is closed."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._buffer = bytearray()
        self._closed = False  # the other end is closed (read to its end)
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)

    def send(self, message: Any) -> None:
        self.sock.sendall(encode(message))

    def receive(self, timeout: float | None) -> list[Any]:
        """The messages that have arrived; waits up to ``timeout`` seconds (None: for ever)
        for the first one, not at all for more. EOFError once the other end is closed and
        every message before that was taken."""
        messages = self._complete_frames()
        while not messages:
            if self._closed:
                raise EOFError("the other process closed the channel")
            if not self._selector.select(timeout):
                return []
            self._read_available()
            messages = self._complete_frames()
            timeout = None if timeout is None else 0.0  # a frame has started: wait for its end
        while not self._closed and self._selector.select(0):  # whatever else is there now
            self._read_available()
            messages += self._complete_frames()
        return messages

    def detach(self) -> tuple[socket.socket, bytes]:
        """Hand the socket to another reader: (the socket, bytes read past the last whole
        frame, which that reader must see first)."""
        self._selector.close()
        return self.sock, bytes(self._buffer)

    def close(self) -> None:
        self._selector.close()
        self.sock.close()

    def _read_available(self) -> None:
        data = self.sock.recv(READ_BYTES)
        self._closed = not data
        self._buffer += data

    def _complete_frames(self) -> list[Any]:
        messages, start, buffer = [], 0, self._buffer
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if len(buffer) < end:
                break
            with memoryview(buffer) as view:  # released before the buffer is cut below
                messages.append(pickle.loads(view[start + HEADER.size : end]))
            start = end
        del buffer[:start]
        return messages


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message on the API process's end (asyncio.IncompleteReadError at the end)."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))
