"""How many tokens each request drafts in a step: the cost model of verifying n drafts and the
per-request acceptance estimate that picks n (docs/architecture.md, "How many drafts").

Switching speculation off where it does not pay: verifying n drafts (a forward over n + 1 tokens)
costs more than a plain decode step. ``verify_costs`` gives that cost in decode steps, a fixed table
per device and dtype measured on our CPU (docs/benchmarks.md). On CPU it is not linear in n: in
float32 the first extra token costs most (a different matmul shape), then the cost is nearly flat;
in bfloat16 every token adds ~0.5 with torch's matmul; with the compiled kernels (``Backend.cpu``,
where they run) ~0.1 in both dtypes, and with their bfloat16 AMX kernel ~0.03. On a GPU with
captured graphs every step drafts and verifies at a fixed shape (k drafts, k + 1 rows per request),
so a step with drafts costs the same whatever n: ``measured_costs`` times the captured decode,
verify and draft graphs once at start-up, on the scratch slot, and rounds the ratio to 0.05 steps
(``SpeculativeDecoder.capture``; without graphs, 1 + 0.01 n). Where the costs are not measured, a
proposer with a model of its own adds ``n * draft_cost`` (the bytes of its model's matmul weights
over the target's: a float32 EAGLE head of the bundled model's 4-bit GGUF ~0.4). Beyond that it is
deliberately not timed at run time: the number of drafts must not depend on the machine's momentary
load or on the batch, or a seeded request would stop being reproducible. Each request keeps an
estimate of its per-token acceptance rate alpha and drafts ``n = argmax_n E(n) / cost(n)`` tokens,
with ``E(n) = (1 - alpha^(n+1)) / (1 - alpha)`` the expected tokens per step (Leviathan et al.).
alpha is accepted drafts over drafts *tried*, each an exponential average over the request's own
steps with drafts: drafts after the first rejected one were never tried (counting them as failures,
accepted / drafted, read a per-position profile 0.39, 0.16, 0.06 as alpha 0.2 instead of 0.4 and
drafted half as often as pays). A request whose drafts keep failing therefore drops to ``n = 0`` (a
plain decode step); every ``REPROBE_STEPS`` steps it drafts one token again so a request whose text
becomes predictable (a quoted passage, code being repeated) is noticed; each failed probe doubles
that interval (up to ``MAX_REPROBE_STEPS``), a passing one resets it, so free text pays almost
nothing for probing. Synthetic mode never switches off: the user asked for a given acceptance.

``DraftPlanner`` holds the estimate of each slot; a preempted request takes its own with it
(``state``, then ``start`` when it is readmitted: docs/design.md §13), so its draft plan, hence its
tokens, go on as if it had never left.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verispec.ops.backend import get_backend
from verispec.runtime.model_runner import ModelRunner

ALPHA_PRIOR = 0.8  # a new request starts optimistic: full k, backing off as drafts fail
PRIOR_TRIALS = 1.0  # the prior's weight, in drafts tried
ALPHA_DECAY = 0.9  # weight of the old estimate in the exponential averages
REPROBE_STEPS = 16
MAX_REPROBE_STEPS = 256


# Cost of a forward over 1, 2, 3, ... new tokens in one-token steps (bundled model, ~100-400
# cached tokens, 2-core AVX2 CPU, medians; docs/benchmarks.md), made non-decreasing.
CPU_VERIFY_COSTS = {
    torch.float32: (1.0, 1.7, 2.0, 2.0, 2.0, 2.05, 2.1),
    torch.bfloat16: (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 3.9),
}
# Where the compiled kernels run the matmuls of a few rows (Backend.cpu: each weight row
# read once for up to four input rows), both dtypes; the measured ranges are in
# docs/benchmarks.md.
CPU_VERIFY_COSTS_WITH_KERNELS = (1.0, 1.1, 1.2, 1.25, 1.4, 1.5, 1.65)
# bfloat16 through the AMX kernel (up to 16 rows cost about one; passive and spinning OpenMP
# workers; docs/benchmarks.md).
CPU_VERIFY_COSTS_AMX = (1.0, 1.05, 1.07, 1.1, 1.1, 1.12, 1.17)
GPU_COST_PER_TOKEN = 0.01  # memory-bound decode: a few more rows are nearly free


def verify_costs(device: torch.device, dtype: torch.dtype, max_n: int) -> tuple[float, ...]:
    """``costs[n]``: a forward over ``n + 1`` new tokens, in one-token decode steps, for
    ``n = 0 .. max_n`` (past the table, the table's last step repeats); on a CPU, with the
    compiled kernels where the device's backend has them."""
    if device.type == "cuda":
        return tuple(1.0 + GPU_COST_PER_TOKEN * n for n in range(max_n + 1))
    table = list(CPU_VERIFY_COSTS.get(dtype, CPU_VERIFY_COSTS[torch.bfloat16]))
    kernels = get_backend(device).cpu
    if dtype in (torch.bfloat16, torch.float32) and kernels is not None:
        table = list(CPU_VERIFY_COSTS_WITH_KERNELS)
        if dtype == torch.bfloat16 and "amx" in kernels.bf16_isas():
            table = list(CPU_VERIFY_COSTS_AMX)
    while len(table) < max_n + 1:
        table.append(table[-1] + (table[-1] - table[-2]))
    return tuple(table[: max_n + 1])


COST_ROUNDING = 0.05  # measured step costs are rounded to this many decode steps


def measured_costs(runner: ModelRunner, proposer, k: int) -> tuple[float, ...] | None:
    """``costs[n]`` from the captured graphs (None without them): a step with drafts costs the
    verify graph plus the proposer's captured draft (if any) over the decode graph, whatever
    n >= 1; timed at batch 1 before any request ran (inputs on the scratch slot)."""
    graphs = runner.graphs
    if graphs is None or not graphs.capture_graphs:
        return None
    decode = graphs.time_step(runner.graph_name(1))
    step = graphs.time_step(runner.graph_name(k + 1))
    draft_graphs = None if proposer.runner is None else proposer.runner.graphs
    name = proposer.graph_name
    if draft_graphs is not None and name is not None and draft_graphs.has(name):
        step += draft_graphs.time_step(name)
    ratio = max(1.0, round(step / decode / COST_ROUNDING) * COST_ROUNDING)
    return (1.0,) + (ratio,) * k


def best_num_drafts(alpha: float, max_n: int, costs: Sequence[float]) -> int:
    """``argmax_{0 <= n <= max_n} E(n) / costs[n]`` with ``E(n) = sum_{i<=n} alpha^i`` (0 drafts
    unless some n is strictly better than a plain step)."""
    best_n, best_value, expected, power = 0, 1.0 / costs[0], 1.0, 1.0
    for n in range(1, max_n + 1):
        power *= alpha
        expected += power
        value = expected / costs[n]
        if value > best_value * (1.0 + 1e-9):
            best_n, best_value = n, value
    return best_n


class DraftPlanner:
    """Each slot's acceptance estimate (exponential averages of accepted drafts and drafts
    tried; alpha their ratio) and its switch-off state (steps without drafts, probe interval,
    whether the current draft is a probe)."""

    def __init__(self, max_num_seqs: int) -> None:
        # Per slot: exponential averages of accepted drafts and drafts tried; alpha their ratio.
        self._accepted = np.full(max_num_seqs, ALPHA_PRIOR * PRIOR_TRIALS)
        self._tried = np.full(max_num_seqs, PRIOR_TRIALS)
        self._steps_off = np.zeros(max_num_seqs, dtype=np.int64)
        self._probe_interval = np.full(max_num_seqs, REPROBE_STEPS)  # per slot
        self._probing = np.zeros(max_num_seqs, dtype=bool)

    def start(self, slot: int, state: tuple | None = None) -> None:
        """A request took ``slot``: the prior, or the ``state`` it kept when it was preempted."""
        if state is None:
            state = (ALPHA_PRIOR * PRIOR_TRIALS, PRIOR_TRIALS, 0, REPROBE_STEPS, False)
        (self._accepted[slot], self._tried[slot], self._steps_off[slot],
         self._probe_interval[slot], self._probing[slot]) = state

    def state(self, slot: int) -> tuple:
        """The estimate of the request in ``slot``, for ``start`` after a preemption."""
        return (self._accepted[slot], self._tried[slot], self._steps_off[slot],
                self._probe_interval[slot], self._probing[slot])

    def plan(self, slot: int, max_n: int, costs: Sequence[float]) -> int:
        """Drafts for the request in ``slot`` this step (``max_n`` >= 1 at most): the best
        number for its alpha, or one when a switched-off request's probe is due."""
        planned = best_num_drafts(self.alpha(slot), max_n, costs)
        if planned == 0:
            self._steps_off[slot] += 1
            if self._steps_off[slot] >= self._probe_interval[slot]:
                self._steps_off[slot] = 0
                self._probing[slot] = True
                planned = 1  # probe: one draft, its outcome updates alpha
        return planned

    def alpha(self, slot: int) -> float:
        """The request in ``slot``'s estimated per-draft acceptance rate."""
        return float(self._accepted[slot] / self._tried[slot])

    def observe(self, slot: int, num_drafts: int, num_accepted: int) -> None:
        """Update a request's acceptance estimate (and probe interval) after a step with drafts."""
        tried = num_accepted + (num_accepted < num_drafts)  # the first rejected one ends it
        self._accepted[slot] = ALPHA_DECAY * self._accepted[slot] + (1 - ALPHA_DECAY) * num_accepted
        self._tried[slot] = ALPHA_DECAY * self._tried[slot] + (1 - ALPHA_DECAY) * tried
        if self._probing[slot]:
            self._probing[slot] = False
            interval = REPROBE_STEPS if num_accepted else 2 * self._probe_interval[slot]
            self._probe_interval[slot] = min(interval, MAX_REPROBE_STEPS)
