"""The processes of a tensor-parallel engine (docs/design.md §14).

Every rank runs the whole engine: scheduler, proposer, sampler, rejection sampler. Only the
model is split (``models.parallel``). The ranks stay in step because they make the same
decisions from the same inputs: the same requests in the same order, the same seeds, the same
gathered logits and Philox streams, and the start-up measurements of rank 0 (the KV pool's
size is the smallest of the ranks', the speculative step costs are rank 0's). No rank reads
another's host state during a step; the collectives inside the model are the only
synchronisation.

Two ways to start:

- ``LLM(..., tensor_parallel_size=N)`` in a plain process: that process becomes rank 0 and
  spawns ranks 1..N-1 (``WorkerGroup``). Each engine call that changes state (a request added
  or aborted, the prefix cache reset) is queued and sent with the next ``step`` as one message
  per worker; the workers apply them in the same order and step too.
- Under ``torchrun`` (``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` in the environment, env://
  rendezvous): every rank runs the user's script, so each engine sees the same calls and no
  messages are needed.

A worker that dies makes rank 0 raise ``WorkerDied`` naming it (a watchdog thread watches
the workers and aborts the process group so a collective that waits on the dead rank
returns); workers exit when rank 0's process goes away.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verispec.models.parallel import SINGLE, TensorParallel

logger = logging.getLogger("verispec")

# Multicast over NVLink is never used (it can put a shared host's GPUs out of service):
# collectives take peer-to-peer paths only.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
# How long a collective may wait for a rank (start-up compiles kernels and captures graphs).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
WORKER_START_TIMEOUT_S = 1800.0
SHUTDOWN_TIMEOUT_S = 30.0
# How long workers left in an interrupted step's collectives get before they are killed.
INTERRUPTED_GRACE_S = 2.0


class WorkerDied(RuntimeError):
    """A tensor-parallel rank stopped; the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: ``cuda:(index + r)`` for CUDA (index 0 unless given), the CPU as is."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism needs a GPU per rank: rank {rank} would run on "
                         f"cuda:{index}, but {torch.cuda.device_count()} GPU(s) are visible")
    return torch.device("cuda", index)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def start(size: int, device: torch.device, engine_cls: type, engine_kwargs: dict[str, Any]
          ) -> tuple[TensorParallel, torch.device, WorkerGroup | None]:
    """This process's place in a group of ``size`` ranks, its device, and the workers it
    spawned (None when it spawned none: a single rank, a spawned worker, or ``torchrun``).
    A spawned worker builds ``engine_cls(**engine_kwargs)``, the engine rank 0 builds."""
    if size == 1:
        return SINGLE, device, None
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    workers = None
    if _STUCK:
        raise RuntimeError(f"tensor_parallel_size={size}: {_STUCK[0]}")
    running = _running_group()
    if running is not None:
        raise ValueError(f"tensor_parallel_size={size}: a tensor-parallel engine already runs "
                         "in this process (one per process, as its ranks share the default "
                         "process group); close() it first")
    if dist.is_initialized():  # a worker spawned below, or a script that set up the group
        if dist.get_world_size() != size:
            raise ValueError(f"tensor_parallel_size={size}, but the torch.distributed group "
                             f"has {dist.get_world_size()} ranks")
        rank = dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size={size}, but torchrun started "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        _set_device(device, local_rank)
        dist.init_process_group(_backend(device), init_method="env://", rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT)
        # The group this engine formed is left at exit, before the interpreter tears down
        # the backend's threads (gloo's, left alive, can abort the process at exit).
        atexit.register(leave_group)
    else:
        rank = local_rank = 0
        _rank_device(device, size - 1)  # every rank has a GPU
        workers = WorkerGroup(size, device, engine_cls, engine_kwargs)
        _RUNNING.append(weakref.ref(workers))
    device = _set_device(device, local_rank)
    return TensorParallel(rank, size), device, workers


# The engine this process spawned workers for (at most one: it owns the default group).
_RUNNING: list[weakref.ref] = []


def _running_group() -> WorkerGroup | None:
    group = _RUNNING[-1]() if _RUNNING else None
    if group is None or group.closed:
        _RUNNING.clear()
        return None
    return group


def _set_device(device: torch.device, local_rank: int) -> torch.device:
    device = _rank_device(device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class WorkerGroup:
    """Ranks 1..N-1 of an engine started in this process (rank 0): spawns them, sends them
    each step's commands, watches them and shuts them down."""

    def __init__(self, size: int, device: torch.device, engine_cls: type,
                 engine_kwargs: dict[str, Any]) -> None:
        port = _free_port()
        context = multiprocessing.get_context("spawn")
        self.processes: list[Any] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self._queued: list[tuple] = []
        self.failure: str | None = None
        self._closing = threading.Event()  # set before the workers are told to exit
        # set from a step's message until rank 0's step returns: an engine closed while it is
        # set (Ctrl-C or an error mid-step) has workers waiting in that step's collectives
        self._in_step = threading.Event()
        for rank in range(1, size):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main, name=f"verispec-tp{rank}",
                args=(rank, size, port, str(device), engine_cls, engine_kwargs, child,
                      os.getpid()))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self._watchdog = threading.Thread(target=self._watch, name="verispec-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()
        dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns,
                                           self._closing, self._in_step)

    def _watch(self) -> None:
        """Until shutdown: when a worker exits, record why and abort the process group, so a
        collective of rank 0 that waits on it returns with an error instead of hanging."""
        sentinels = {p.sentinel: p for p in self.processes}
        while sentinels and not self._closing.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if self._closing.is_set():
                return
            for sentinel in ready:
                process = sentinels.pop(sentinel)
                process.join(5.0)  # reap it: its exit code
                message = self._error_message(process)
                self.failure = (f"tensor-parallel worker {process.name} (pid {process.pid}) "
                                f"exited with code {process.exitcode}" + message)
                logger.error("%s", self.failure)
                try:
                    dist.distributed_c10d._abort_process_group()
                except Exception:  # noqa: BLE001 - gloo's collectives fail on their own
                    pass
                return

    def _error_message(self, process) -> str:
        conn = self.conns[self.processes.index(process)]
        try:
            while conn.poll(0):
                kind, *payload = conn.recv()
                if kind == "error":
                    return ": " + payload[0]
        except (EOFError, OSError):
            pass
        return ""

    def wait_ready(self) -> None:
        """Block until every worker has built its engine (or raise what stopped one)."""
        for process, conn in zip(self.processes, self.conns):
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            while not conn.poll(0.2):
                self.check()
                if time.monotonic() > deadline:
                    raise WorkerDied(f"tensor-parallel worker {process.name} did not start")
            kind, *payload = conn.recv()
            if kind == "error":
                raise WorkerDied(f"tensor-parallel worker {process.name} failed to start: "
                                 f"{payload[0]}")

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerDied(self.failure)

    def failure_after_error(self, timeout_s: float = 30.0, grace_s: float = 2.0) -> str | None:
        """After a step of rank 0 failed: why a worker died, or None if every worker still
        lives after ``grace_s``. A collective can fail on a dead peer's closed socket before
        the watchdog has recorded the death, even before the peer's exit is complete (its
        sockets close first), so a death is waited for up to ``timeout_s``."""
        start = time.monotonic()
        while self.failure is None and time.monotonic() - start < timeout_s:
            if time.monotonic() - start >= grace_s and all(p.is_alive() for p in self.processes):
                return None
            time.sleep(0.05)
        return self.failure

    def queue(self, command: tuple) -> None:
        """A state change (``("add", ...)``, ``("abort", ids)``, ``("reset",)``) for the
        workers, sent with the next step."""
        self._queued.append(command)

    def step(self) -> None:
        """Tell every worker to apply the queued commands and run one step (``step_done``
        when rank 0's own step has returned)."""
        self.check()
        message, self._queued = ("step", self._queued), []
        self._in_step.set()
        try:
            for conn in self.conns:
                conn.send(message)
        except (BrokenPipeError, OSError):
            time.sleep(1.0)  # let the watchdog record which worker went away
            self.check()
            raise WorkerDied("a tensor-parallel worker stopped") from None

    def step_done(self) -> None:
        self._in_step.clear()

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        self._finalizer()


# How long a rank waits for its NCCL communicators to be torn down when an engine closes.
LEAVE_TIMEOUT_S = 20.0
# Set when a teardown did not finish: this process's default group cannot be formed again.
_STUCK: list[str] = []


def leave_group(timeout_s: float | None = None) -> None:
    """Leave the default process group so that another engine can form one. gloo's is
    destroyed. NCCL's is aborted once this rank's work is done (a destroy waits on the other
    ranks' teardown); the abort can itself hang on the GPU (docs/design.md §14), so it runs in a
    thread given ``timeout_s`` (default ``LEAVE_TIMEOUT_S``): past it the engine's close returns,
    an error is logged, and this process refuses to start another tensor-parallel engine."""
    if not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    torch.cuda.synchronize()
    done = threading.Event()

    def abort() -> None:
        dist.distributed_c10d._abort_process_group()
        done.set()

    threading.Thread(target=abort, name="verispec-tp-leave", daemon=True).start()
    timeout_s = LEAVE_TIMEOUT_S if timeout_s is None else timeout_s
    if not done.wait(timeout_s):
        message = (f"leaving the NCCL process group did not finish in {timeout_s:g} s; this "
                   "process cannot start another tensor-parallel engine (start each one in a "
                   "process of its own)")
        logger.error("%s", message)
        _STUCK.append(message)


def _shutdown(processes, conns, closing: threading.Event, in_step: threading.Event) -> None:
    """Ask each worker to exit, leave the process group, then make sure each worker exited
    (no process outlives the engine). Closed mid-step (Ctrl-C, an error), the workers wait in
    that step's collectives and never read "exit": the group is aborted and they are killed
    after ``INTERRUPTED_GRACE_S``."""
    closing.set()
    for conn in conns:
        try:
            conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
    interrupted = in_step.is_set()
    if all(p.is_alive() for p in processes) and not interrupted:
        leave_group()
    elif dist.is_initialized():  # a dead rank or an abandoned step: nothing may wait for it
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - the processes are killed below in any case
            pass
    deadline = time.monotonic() + (INTERRUPTED_GRACE_S if interrupted else SHUTDOWN_TIMEOUT_S)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(rank: int, size: int, port: int, device: str, engine_cls: type,
                engine_kwargs: dict[str, Any], conn, parent_pid: int) -> None:
    """A spawned rank: join the group, build the same engine, then replay rank 0's calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    # The engine below finds its rank's device as torchrun's ranks do: LOCAL_RANK GPUs past
    # rank 0's (given explicitly, so that this process's current device does not shift it).
    os.environ["LOCAL_RANK"] = str(rank)
    engine_kwargs = {**engine_kwargs, "device": device}
    try:
        torch_device = _set_device(torch.device(device), rank)
        if torch_device.type == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group(_backend(torch_device), init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        llm = engine_cls(**engine_kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    conn.send(("ready",))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if message[0] == "exit":
                llm.drop_graphs()
                break
            for command in message[1]:
                llm.apply_command(command)
            llm.step()
    except BaseException as e:  # noqa: BLE001
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (BrokenPipeError, OSError):
            pass
        raise SystemExit(1) from None
    leave_group()
