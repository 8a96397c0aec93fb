"""The dispatch point: which implementation of every kernel runs on a device type, chosen once
(docs/design.md §17).

Every op has a torch twin (the reference, and the CPU path) and, for CUDA, a Triton version with
the same signature; on x86-64 CPUs some also have a compiled C kernel (``ops.cpu_kernels``).
``get_backend(device)`` returns the ``Backend`` of the device's type, built on first use:

- sampling and verification: Triton on CUDA where Triton is installed; elsewhere the torch
  twins, given the compiled race, rejection rows and Philox rounds on a CPU that runs them;
- the model on the flat token layout (``ModelOps``): Triton on CUDA, the torch twins elsewhere;
- the model on the padded CPU layout (``models.llama``), the tree ops and the CPU cost model:
  ``Backend.cpu``, the compiled kernels where they run, else torch.

Overrides, read here only: ``VERISPEC_BACKEND=torch|triton`` picks the sampling and verification
ops (to compare them), ``VERISPEC_CPU_KERNELS=0`` leaves the compiled CPU kernels out."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from verispec.ops import cpu_kernels, options, rejection, sampling
from verispec.ops.model_ops import TORCH_MODEL_OPS, ModelOps, triton_model_ops


@dataclass(frozen=True)
class Backend:
    """Every op of one device type, each implementation chosen once; the sampling and
    verification ops have the torch twins' signatures."""

    name: str  # the sampling and verification ops: "torch" (the twins) or "triton"
    device_type: str
    processed_probs: Callable[..., torch.Tensor]
    sample: Callable[..., torch.Tensor]
    sample_draft: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rejection_sample: Callable[..., torch.Tensor]
    apply_penalties: Callable[..., None]
    apply_token_bitmask: Callable[..., None]
    # The compiled CPU kernels where they run (a CPU that built them, not switched off), else
    # None: the namespace ``ops.cpu_kernels``, as ``torch.ops`` holds compiled ops. Ops that can
    # use them take them as their ``kernels`` argument.
    cpu: ModuleType | None = None

    def model_ops(self, batch_invariant: bool = True) -> ModelOps:
        """The model's ops on the flat layout: Triton on CUDA (with ``batch_invariant=False``,
        torch's matmul), the torch twins elsewhere."""
        if self.device_type != "cuda":
            return TORCH_MODEL_OPS
        if importlib.util.find_spec("triton") is None:
            raise ValueError("running on CUDA needs Triton: pip install 'verispec[gpu]'")
        return triton_model_ops(batch_invariant)

    def torch_has_fast_bf16(self) -> bool:
        """torch's own bfloat16 matmul is fast here: on CUDA, and on a CPU where oneDNN has
        bfloat16 instructions (elsewhere torch widens every weight for every row)."""
        return self.device_type == "cuda" or (self.device_type == "cpu"
                                              and cpu_kernels.torch_has_fast_bf16())

    def quant_kernels(self) -> ModuleType | None:
        """``cpu`` where it also runs GGUF-quantised weights (``quant_linear``: AVX-512)."""
        return self.cpu if self.cpu is not None and self.cpu.quant_available() else None


# name -> factory(device_type, cpu kernels or None): the sampling and verification ops
_FACTORIES: dict[str, Callable[[str, ModuleType | None], Backend]] = {}


def register_backend(name: str, factory: Callable[[str, ModuleType | None], Backend]) -> None:
    """Register a backend by name; ``factory(device_type, cpu)`` is called (imports happen) on
    first use only."""
    _FACTORIES[name] = factory


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


@functools.cache
def _build(device_type: str, name: str, cpu_kernels_on: bool) -> Backend:
    if name not in _FACTORIES:
        raise ValueError(f"backend must be one of {available_backends()}, got {name!r}")
    runs = device_type == "cpu" and cpu_kernels_on and cpu_kernels.available()
    return _FACTORIES[name](device_type, cpu_kernels if runs else None)


@functools.cache
def _default_name(device_type: str) -> str:
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def default_backend_name(device: torch.device | str) -> str:
    """``triton`` on CUDA when Triton is installed, else ``torch``; the environment may override."""
    return os.environ.get("VERISPEC_BACKEND") or _default_name(torch.device(device).type)


def _cpu_kernels_on() -> bool:
    return os.environ.get("VERISPEC_CPU_KERNELS", "1") != "0"


def get_backend(device: torch.device | str) -> Backend:
    """The backend of ``device``'s type (built once per type and overrides)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    name = os.environ.get("VERISPEC_BACKEND") or _default_name(device_type)
    return _build(device_type, name, _cpu_kernels_on())


def load_backend(name: str) -> Backend:
    """Backend ``name`` as a CPU holds it (tests compare the implementations on one input)."""
    return _build("cpu", name, _cpu_kernels_on())


# Logits of at most this many elements are sampled on a CPU by one thread. Each of the ~20
# torch ops of a rejection step over [k + 1, V] rows opens an OpenMP parallel region, and with
# passive workers (``verispec.cpu_threads``) each region waits for a worker to wake, which at
# these sizes costs more than a second thread saves (docs/benchmarks.md).
# These ops split their work by rows, never within one, so a row's bits do not depend on the
# number of threads (tests/ops/test_sampling.py); a large batch keeps them all.
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


def _torch_backend(device_type: str, cpu: ModuleType | None) -> Backend:
    def twin(op: Callable) -> Callable:  # given the compiled CPU kernels where they run
        return _few_rows_on_one_thread(op if cpu is None else functools.partial(op, kernels=cpu))

    return Backend(
        name="torch",
        device_type=device_type,
        processed_probs=_few_rows_on_one_thread(sampling.processed_probs),
        sample=twin(sampling.sample),
        sample_draft=twin(sampling.sample_draft),
        rejection_sample=twin(rejection.rejection_sample),
        apply_penalties=options.apply_penalties,
        apply_token_bitmask=twin(options.apply_token_bitmask),
        cpu=cpu,
    )


def _triton_backend(device_type: str, cpu: ModuleType | None) -> Backend:
    # imports triton (the optional gpu extra): when chosen
    from verispec.ops import triton_ops, triton_options

    return Backend(
        name="triton",
        device_type=device_type,
        processed_probs=triton_ops.processed_probs,
        sample=triton_ops.sample,
        sample_draft=triton_ops.sample_draft,
        rejection_sample=triton_ops.rejection_sample,
        apply_penalties=triton_options.apply_penalties,
        apply_token_bitmask=triton_options.apply_token_bitmask,
        cpu=cpu,
    )


register_backend("torch", _torch_backend)
register_backend("triton", _triton_backend)
