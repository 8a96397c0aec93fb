"""Launching a compiled Triton kernel with little host time, for the plans of ``triton_ops``.

A plan (one kind of call: its shapes, strides, dtypes, devices, alignment, flags and stream, as
``_signature`` keys it) makes one ``_Launch`` per kernel: the first call compiles through Triton,
every later one hands Triton's launcher for the compiled kernel its full argument list. Also the
device facts a plan reads: the current stream, programmatic dependent launch, the SM count.
"""

from __future__ import annotations

import functools
import inspect

import torch

from verispec.ops.triton_kernels import INTERPRET


def _is_constexpr(param: inspect.Parameter) -> bool:
    """Whether a kernel parameter is annotated ``tl.constexpr`` (a string in modules with
    postponed annotations, as Triton reads it too)."""
    annotation = param.annotation
    return annotation is not param.empty and "constexpr" in (
        annotation if isinstance(annotation, str) else repr(annotation))


class _Launch:
    """One launch of a plan. The first call compiles through ``kernel[grid](...)``; later
    calls hand Triton's launcher for the compiled kernel its full argument list: the grid,
    the stream, the constexprs in place, the arguments the plan fixes filled in once, and
    every pointer as an integer. That skips Triton's per-call argument binding and, per
    tensor, a ``data_ptr`` call and a driver query of the pointer (the plan has checked the
    devices): a few microseconds of host time instead of tens. Launch hooks are not called.
    ``static``: runtime arguments fixed by the plan, by name; a call passes the stream and
    the others (tensors) in the kernel's order."""

    def __init__(self, kernel, grid: tuple, num_warps: int, constexprs: dict,
                 launch_pdl: bool = False, **static):
        self.kernel, self.grid, self.num_warps, self.constexprs = (
            kernel, grid, num_warps, constexprs)
        self.options = dict(launch_pdl=True) if launch_pdl else {}
        self.static = list(static.values())  # kept alive: the launches hold their pointers
        # the compiled kernel's arguments; where the call's go; the runtime ones (first call)
        self.template, self.slots, self.runtime = [], [], []
        for p in inspect.signature(kernel.fn).parameters.values():
            if _is_constexpr(p):
                self.template.append(constexprs[p.name])
                continue
            self.runtime.append(len(self.template))
            if p.name not in static:
                self.slots.append(len(self.template))
            self.template.append(static.pop(p.name, None))
        assert not static, f"{kernel.fn.__name__} has no arguments {sorted(static)}"
        self.run = None

    def __call__(self, stream: int, *args) -> None:
        if self.run is not None:
            full = self.template.copy()
            full[3] = stream
            for slot, arg in zip(self.slots, args):
                full[slot] = arg.data_ptr()
            self.run(*full)
            return
        full = self.template.copy()
        for slot, arg in zip(self.slots, args):
            full[slot] = arg
        compiled = self.kernel[self.grid](*[full[i] for i in self.runtime],
                                          num_warps=self.num_warps, **self.options,
                                          **self.constexprs)
        if not INTERPRET:  # [grid x, y, z, stream, function, metadata, no hooks] + arguments
            grid = (*self.grid, *(1,) * (3 - len(self.grid)))
            head = [*grid, None, compiled.function, compiled.packed_metadata, None, None, None]
            self.template = head + [value.data_ptr() if isinstance(value, torch.Tensor)
                                    else value for value in self.template]
            self.slots = [len(head) + slot for slot in self.slots]
            self.run = compiled.run


def _signature(t: torch.Tensor | None, skip_rows: bool = False):
    """What a plan depends on in one input: everything Triton specializes on but the values
    (``skip_rows``: but the first dimension, a row count the kernels read; not a tensor: its
    type, in a key no plan can have, so the plan's checks name it)."""
    if not isinstance(t, torch.Tensor):
        return None if t is None else type(t)
    return (t.shape[1:] if skip_rows else t.shape), t.stride(), t.dtype, t.get_device(), \
        t.data_ptr() & 15


def _stream(t: torch.Tensor) -> int:
    """The current stream of ``t``'s device, as Triton's launcher takes it (0 on the CPU)."""
    index = t.get_device()
    return 0 if index < 0 or INTERPRET else torch._C._cuda_getCurrentRawStream(index)


@functools.cache
def _pdl(index: int) -> bool:
    """Whether a launch may start before the launch before it ends (programmatic dependent
    launch: Hopper and later; not under the interpreter): the finish launch of a plan after
    its rows launch."""
    if INTERPRET or index < 0:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
