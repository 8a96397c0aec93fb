"""The synchronisation of the row-ordered one-hot kernel as the GPU runs it: the kernel compiled
for sm_90 without a GPU (Triton compiles for a target it is given; ptxas ships with it), in a
fresh process without TRITON_INTERPRET, so that the CUDA versions of the helpers are built.

The interpreter runs programs one after another, so it cannot show a count made by every thread
instead of one (a row counter that overshoots leaves its decider polling forever) or an early-word
read that became an atomic again; the PTX can."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from verispec.ops.triton_kernels_rows import _rows_kernel

    pointers = dict(logits_ptr="*fp32", draft_ids_ptr="*i64", cu_ptr="*i64",
                    temperature_ptr="*fp32", seeds_ptr="*i64", positions_ptr="*i64",
                    rates_ptr="*fp32", part_f_ptr="*fp32", part_i_ptr="*i32",
                    race_f_ptr="*fp32", race_i_ptr="*i32", row_token_ptr="*i32",
                    draft_logit_ptr="*fp32", sync_ptr="*i32", token_ids_ptr="*i32")
    const = dict(ROWS=5, NUM_CHUNKS=32, CHUNK=4096, NC_P2=32, ROWS_P2=8, WIDTH_P2=8,
                 BLOCK=4096, NUM_BLOCKS=32, NB_P2=32, BLOCK_SPAN=4096, RACE_SUB=1024,
                 SYNTHETIC=False, HELPERS=16, HELPER_TILE=256, HELPERS_P2=16, GROUP=1)
    names = _rows_kernel.arg_names
    signature = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=_rows_kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    print(compiled.asm["ptx"])
""")


@pytest.fixture(scope="module")
def ptx():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_row_counts_are_single_thread_reductions(ptx):
    """Each count is one thread's ``red`` (no old value to wait for): relaxed for a skipped
    program, release after a program's partials."""
    reds = [line for line in ptx.splitlines() if re.search(r"\bred\.", line) and "add" in line]
    assert any("red.release.gpu.global.add.u32" in line for line in reds)
    assert any("red.relaxed.gpu.global.add.u32" in line for line in reds)
    for line in reds:  # one thread: ours tests %tid.x, Triton's own carry its predicate
        assert ("mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; @p red." in line
                or line.strip().startswith("@%p")), line


def test_decider_polls_and_early_word_are_loads(ptx):
    """The decider's polls are acquiring loads and the early word a relaxed load, each made by
    one thread (predicated) rather than atomics the L2 executes."""
    lines = ptx.splitlines()
    acquire = [line for line in lines if "ld.global.gpu.acquire.b32" in line]
    relaxed = [line for line in lines if "ld.global.gpu.relaxed.b32" in line]
    assert acquire and relaxed
    for line in acquire + relaxed:
        assert line.strip().startswith("@%p"), line
    assert not any("atom.global.gpu.relaxed.or.b32" in line and ", 0;" in line
                   for line in lines)
