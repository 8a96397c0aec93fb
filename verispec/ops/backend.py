"""Backend registry: every op has one signature and a torch twin; the backend is chosen once per
device type. ``torch`` runs everywhere (the CPU path and the test oracle); ``triton`` runs on CUDA
devices when Triton is importable. ``VERISPEC_BACKEND=torch|triton`` overrides the choice."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.ops import options, rejection, sampling


@dataclass(frozen=True)
class Backend:
    """The ops of one backend, all with the torch twins' signatures."""

    name: str
    processed_probs: Callable[..., torch.Tensor]
    sample: Callable[..., torch.Tensor]
    sample_draft: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rejection_sample: Callable[..., torch.Tensor]
    apply_penalties: Callable[..., None]


_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register a backend by name; ``factory`` is called (imports happen) on first use only."""
    _FACTORIES[name] = factory


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


@functools.cache
def load_backend(name: str) -> Backend:
    if name not in _FACTORIES:
        raise ValueError(f"backend must be one of {available_backends()}, got {name!r}")
    return _FACTORIES[name]()


def default_backend_name(device: torch.device | str) -> str:
    """``triton`` on CUDA when Triton is installed, else ``torch``; the environment may override."""
    override = os.environ.get("VERISPEC_BACKEND")
    if override:
        return override
    device = torch.device(device)
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def get_backend(device: torch.device | str) -> Backend:
    return load_backend(default_backend_name(device))


# Logits of at most this many elements are sampled on a CPU by one thread. Each of the ~20
# torch ops of a rejection step over [k + 1, V] rows opens an OpenMP parallel region, and with
# passive workers (``verispec.cpu_threads``) each region waits for a worker to wake, which at
# these sizes costs more than a second thread saves (docs/benchmarks.md).
# These ops split their work by rows, never within one, so a row's bits do not depend
# on the number of threads (tests/ops/test_sampling.py); a large batch keeps them all.
ONE_THREAD_ELEMENTS = 1 << 21


@contextlib.contextmanager
def few_rows_on_one_thread(device: torch.device | str, num_elements: int):
    """Run the block on one CPU thread when it works on at most ``ONE_THREAD_ELEMENTS``
    elements on a CPU (the sampling ops, and a proposer storing its q); elsewhere as is."""
    threads = torch.get_num_threads()
    if threads == 1 or torch.device(device).type != "cpu" or num_elements > ONE_THREAD_ELEMENTS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _few_rows_on_one_thread(op: Callable) -> Callable:
    """``op`` (its first parameter the logits) on one thread for small CPU logits."""
    first = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def run(*args, **kwargs):
        logits = args[0] if args else kwargs.get(first)
        if not isinstance(logits, torch.Tensor):
            return op(*args, **kwargs)
        with few_rows_on_one_thread(logits.device, logits.numel()):
            return op(*args, **kwargs)

    return run


def _torch_backend() -> Backend:
    return Backend(
        name="torch",
        processed_probs=_few_rows_on_one_thread(sampling.processed_probs),
        sample=_few_rows_on_one_thread(sampling.sample),
        sample_draft=_few_rows_on_one_thread(sampling.sample_draft),
        rejection_sample=_few_rows_on_one_thread(rejection.rejection_sample),
        apply_penalties=options.apply_penalties,
    )


def _triton_backend() -> Backend:
    # imports triton (the optional gpu extra): when chosen
    from verispec.ops import triton_ops, triton_options

    return Backend(
        name="triton",
        processed_probs=triton_ops.processed_probs,
        sample=triton_ops.sample,
        sample_draft=triton_ops.sample_draft,
        rejection_sample=triton_ops.rejection_sample,
        apply_penalties=triton_options.apply_penalties,
    )


register_backend("torch", _torch_backend)
register_backend("triton", _triton_backend)
