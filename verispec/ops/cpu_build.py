"""Building and loading the compiled CPU kernels of ``verispec.ops.cpu_kernels``.

The C files are compiled on first use with the system C compiler (``cc -O3 -mavx2 -mfma
-fopenmp``, a few seconds, one log line) into ``$VERISPEC_CACHE/kernels`` (default
``~/.cache/verispec/kernels``) and loaded with ``ctypes``; their OpenMP runtime is the one
torch already loaded, so they share its thread pool. They are built on every x86-64 CPU with
AVX2 (AVX-512 ones included); where that is impossible (another CPU, no compiler)
``load()`` returns None.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from verispec.paths import cache_root

logger = logging.getLogger("verispec")

_SOURCES = [Path(__file__).with_name(name) for name in (
    "bf16_linear.c", "attention.c", "rms_norm.c", "elementwise.c", "sampling.c",
    "thread_pool.c")]
_X512_SOURCE = Path(__file__).with_name("bf16_linear_avx512.c")
# The quantised-weight linear layer (AVX-512; verispec.ops.quant) and the decoder layers over it
# (verispec.ops.cpu_decoder): built with the AVX-512 kernels.
_QUANT_SOURCES = [Path(__file__).with_name(name) for name in ("quant_linear.c", "quant_decoder.c")]
_HEADER = Path(__file__).with_name("cpu_kernels.h")
# -ffp-contract=off: the scalar tails round each product as written (no FMA contraction that
# one inlined copy could get and another not), so every row is summed alike.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


def _cache_dir() -> Path:

    return Path(cache_root()) / "kernels"


def _wanted() -> bool:
    """This CPU can run the kernels (x86-64 Linux with AVX2 and FMA, as every AVX-512 CPU has).
    They are built wherever they can run: they are the CPU path's batch-invariant matmul and
    attention (every row summed in one order whatever the number of rows), and its fast
    bfloat16 matmul where torch has none."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build(compiler: str, sources: list[Path], path: Path) -> None:
    logger.info("building the CPU kernels once (%s) into %s", compiler, path.parent)
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run([compiler, *_FLAGS, *map(str, sources), "-o", str(built), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, path)  # atomic: a concurrent build loads a whole file
    logger.info("built in %.1f s", time.perf_counter() - start)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, built once per source version; None where they cannot be had. A
    compiler too old for the AVX-512 BF16 / AMX intrinsics builds the AVX2 kernels alone."""
    if not _wanted():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = b"".join(path.read_bytes()
                      for path in (*_SOURCES, _X512_SOURCE, *_QUANT_SOURCES, _HEADER))
    tag = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    library, error = None, None
    for sources, suffix in (([*_SOURCES, _X512_SOURCE, *_QUANT_SOURCES], ""),
                            (_SOURCES, "-avx2")):
        path = _cache_dir() / f"cpu_kernels-{tag}{suffix}.so"
        failed = path.with_suffix(".failed")  # a build that failed once is not retried
        if failed.exists():
            continue
        try:
            if not path.exists():
                _build(compiler, sources, path)
            library = ctypes.CDLL(str(path))
            break
        except (OSError, subprocess.SubprocessError) as exc:
            error = exc
            if isinstance(exc, subprocess.CalledProcessError):
                failed.touch()
    if library is None:
        cause = error or f"an earlier build failed; remove {_cache_dir()} to try again"
        warnings.warn(f"verispec: the CPU kernels could not be built ({cause}); "
                      "using torch's ops", RuntimeWarning, stacklevel=2)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("bf16_linear", "bf16_linear_avx512", "bf16_linear_amx"):
        if hasattr(library, name):
            getattr(library, name).restype = ctypes.c_int
            getattr(library, name).argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    if hasattr(library, "bf16_isa"):
        library.bf16_isa.restype = ctypes.c_int
    if hasattr(library, "quant_linear"):
        library.quant_isa.restype = ctypes.c_int
        library.quant_linear.restype = None
        library.quant_linear.argtypes = ([ptr] * 5 + [i64] * 3
                                         + [ctypes.c_int, i64, ctypes.c_int, ctypes.c_int])
    library.f32_linear.restype = None
    library.f32_linear.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    library.rms_norm.restype = None
    library.rms_norm.argtypes = [ptr] * 3 + [ctypes.c_int, i64, i64, ctypes.c_float,
                                             ctypes.c_int]
    library.cache_attention.restype = ctypes.c_int
    library.cache_attention.argtypes = (
        [ptr, i64, ptr, ctypes.c_int, ptr, ptr, ptr] + [i64] * 8
        + [ptr, ctypes.c_int, ctypes.c_float, ctypes.c_int])
    library.silu_mul.restype = None
    library.silu_mul.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_int]
    library.token_bitmask.restype = None
    library.token_bitmask.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr]
    library.philox_uniform.restype = None
    library.philox_uniform.argtypes = [ptr] * 4 + [i64, ptr]
    library.race_rows.restype = None
    library.race_rows.argtypes = [ptr] + [i64] * 3 + [ptr] * 3 + [i64] * 2 + [ptr, ctypes.c_int]
    library.rejection_rows.restype = ctypes.c_int
    library.rejection_rows.argtypes = (
        [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int, ptr, ptr, ptr]
        + [i64] * 3 + [ptr, ptr, ctypes.c_int])
    return library
