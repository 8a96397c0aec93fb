"""How verispec's CPU threads wait: set before torch starts its OpenMP runtime.

torch's CPU ops and verispec's compiled kernels (``ops.cpu_kernels``) run on one OpenMP thread
pool, one thread per core. By default its workers spin after each parallel region (libgomp:
300 000 spins, longer than the gap between two matmuls of a decode step), so an idle verispec
holds every core busy, and on a shared machine the spinning workers take the cores that other
processes, and verispec's own main thread, need: on 2 cores beside one busy process, plain
decode fell to about a third of its idle speed (docs/benchmarks.md). With
``OMP_WAIT_POLICY=PASSIVE`` a worker sleeps as soon as its share is done, and the kernels hand
out work as threads come free (a dynamic schedule), so a loaded machine slows verispec in
proportion to the cores it has left.

``verispec train-draft`` is the exception: a training run keeps every core busy from start to
end, so spinning costs nobody a core, and its steps open thousands of small parallel regions
whose wake-ups would slow every step (``ACTIVE_COMMANDS``).

Heap arenas. glibc gives each thread that allocates its own heap arena (up to 8 per core), and
an arena keeps what its thread freed; the threads of a CPU engine (the tokenizer loading beside
the weights, the OpenMP workers, the kernels' pool) each hold one, which raised the quantised
bundled engine's peak by about 25 MB, a sixth of its weights and KV pool. ``share_one_heap``
asks glibc for one arena shared by every thread (``mallopt(M_ARENA_MAX, 1)``); measured on the
2-core machine, decode and prefill speed were unchanged (docs/benchmarks.md). A value the user
set for ``MALLOC_ARENA_MAX`` is kept.

The OpenMP runtime reads its wait policy once, when torch loads it, so the variable is set by
``import verispec`` only if torch is not imported yet (the CLI always imports verispec first). A
value the user set for ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is kept. A program that imports
torch before verispec sets the variable itself (``OMP_WAIT_POLICY=PASSIVE python app.py``).
"""

from __future__ import annotations

import ctypes
import os
import sys

WAIT_POLICY = "PASSIVE"
# Variables by which a user chooses the wait policy; any of them set means theirs wins.
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


# The verispec command whose workers spin: a training run keeps every core busy for its whole
# length, thousands of small parallel regions a step, and each passive region waits for its
# workers to wake (docs/benchmarks.md).
ACTIVE_COMMANDS = ("train-draft",)


def _policy(argv: list[str]) -> str:
    """``ACTIVE`` for the ``verispec`` command of ``ACTIVE_COMMANDS``, else ``WAIT_POLICY``."""
    command = os.path.basename(argv[0]) if argv else ""
    if command == "verispec" and len(argv) > 1 and argv[1] in ACTIVE_COMMANDS:
        return "ACTIVE"
    return WAIT_POLICY


def set_wait_policy() -> bool:
    """Set ``OMP_WAIT_POLICY`` for the OpenMP runtime torch will load: ``WAIT_POLICY``, or
    spinning workers for ``verispec train-draft`` (``ACTIVE_COMMANDS``).

    Returns True if it was set now; False where it is too late (torch already imported) or the
    user chose a policy themselves."""
    if "torch" in sys.modules or any(name in os.environ for name in USER_VARIABLES):
        return False
    os.environ["OMP_WAIT_POLICY"] = _policy(sys.argv)
    return True


M_ARENA_MAX = -8  # glibc's mallopt parameter


def share_one_heap() -> bool:
    """One glibc heap arena for every thread (module docstring). Returns True if it was set;
    False off glibc, or where the user set ``MALLOC_ARENA_MAX``."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_ARENA_MAX, 1))
