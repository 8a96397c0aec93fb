"""Helpers for ``verispec bench`` and the benchmark scripts: the Leviathan et al. prediction,
an estimate of the per-position acceptance rate, a human table, a plot and progress bars.

Prediction (docs/design.md §10, Leviathan et al. 2023). If every draft position is accepted with
probability alpha given that the ones before it were, and proposing one draft token costs c
target steps, a step with k drafts emits on average

    E[tokens per step] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens (k + 1 at alpha = 1) at a cost of k c + 1 target steps (one verify forward, costed as one
target step), so the expected speedup over plain decoding is

    speedup = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)).

The prompt sets live in ``verispec.bench.prompts`` and are re-exported here. matplotlib
is an optional extra (``pip install 'verispec[plot]'``), imported only when plotting.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from tqdm import tqdm

from verispec.bench.prompts import (
    FREE_PROMPTS,
    GROUNDED_PROMPTS,
    PROMPT_SETS,
    RandomPrompts,
    get_prompts,
    load_jsonl_prompts,
    prompt_set_names,
)

__all__ = [
    "FREE_PROMPTS",
    "GROUNDED_PROMPTS",
    "PROMPT_SETS",
    "RandomPrompts",
    "estimate_acceptance_rate",
    "expected_speedup",
    "expected_tokens_per_step",
    "format_table",
    "get_prompts",
    "leviathan_prediction",
    "load_jsonl_prompts",
    "machine_description",
    "plot_acceptance_and_speedup",
    "print_table",
    "progress",
    "prompt_set_names",
]


def _check_alpha_k(alpha: float, k: int) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"num_speculative_tokens k must be an integer >= 0, got {k!r}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """``(1 - alpha^(k+1)) / (1 - alpha)``: expected output tokens per step with k drafts.

    Summed as the geometric series ``sum_{i=0..k} alpha^i``, which is exact at alpha = 1
    (k + 1) and has no cancellation near it.
    """
    _check_alpha_k(alpha, k)
    return math.fsum(float(alpha) ** i for i in range(k + 1))


def expected_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """``(1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))``: expected speedup over plain decoding.

    Parameters
    ----------
    alpha : per-position acceptance rate in [0, 1]
    k : number of draft tokens per step
    c : cost of proposing one draft token, in target decode steps (draft time per token / target
        time per token); 0 for a free proposer
    verify_cost : cost of the verify forward over k + 1 positions in target decode steps. 1 is
        Leviathan et al.'s assumption (the formula above); pass the measured ratio to correct it.
    """
    _check_alpha_k(alpha, k)
    for name, value in (("c", c), ("verify_cost", verify_cost)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    cost = k * c + verify_cost
    if cost <= 0:
        raise ValueError(f"k * c + verify_cost must be > 0, got {cost!r}")
    return expected_tokens_per_step(alpha, k) / cost


def estimate_acceptance_rate(acceptance_rate_per_pos: Sequence[float]) -> float:
    """Per-position acceptance rate alpha from measured per-position rates (docs/design.md §8).

    ``acceptance_rate_per_pos[i]`` is the unconditional rate a_{i+1} = P(first i + 1 drafts
    accepted) = accepted_per_pos[i] / drafts (``SpecDecodingStats.acceptance_rate_per_pos``).
    Under the model a_i = alpha^i, the maximum-likelihood estimate is accepted positions over
    tried positions:

        alpha = (a_1 + ... + a_k) / (a_0 + ... + a_{k-1}),   a_0 = 1
              = (L - 1) / (L - a_k),                          L = mean acceptance length

    It returns alpha exactly when the rates are geometric. Requests that proposed fewer than k
    drafts (n-gram) count as tried at positions they did not draft, which biases alpha low.
    """
    rates = [float(a) for a in acceptance_rate_per_pos]
    if not rates:
        raise ValueError("acceptance_rate_per_pos must have at least one entry, got []")
    if any(not 0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"acceptance rates must lie in [0, 1], got {rates!r}")
    tried = 1.0 + math.fsum(rates[:-1])
    return min(1.0, math.fsum(rates) / tried)


def leviathan_prediction(
    acceptance_rate_per_pos: Sequence[float], c: float, verify_cost: float = 1.0,
    draft_rate: float = 1.0,
) -> dict[str, float]:
    """The prediction printed beside a measurement: alpha estimated from the measured
    per-position rates (k = their number), expected tokens per step and expected speedup.

    ``draft_rate`` is the measured fraction of a request's decode steps in which the proposer
    drafted (an n-gram proposer finds no match in many): a step without drafts emits one token,
    so the expected tokens per step are ``draft_rate * (1 - alpha^(k+1)) / (1 - alpha) +
    (1 - draft_rate)``. ``c`` and ``verify_cost`` are averages over all speculative steps,
    drafted or not, in plain decode steps.
    """
    alpha = estimate_acceptance_rate(acceptance_rate_per_pos)
    k = len(acceptance_rate_per_pos)
    if isinstance(draft_rate, bool) or not isinstance(draft_rate, (int, float)) or not (
            0.0 <= draft_rate <= 1.0):
        raise ValueError(f"draft_rate must be in [0, 1], got {draft_rate!r}")
    drafted = expected_tokens_per_step(alpha, k)
    tokens = draft_rate * drafted + (1.0 - draft_rate)
    return {
        "alpha": alpha,
        "draft_rate": draft_rate,
        "predicted_tokens_per_step": tokens,
        "predicted_speedup": tokens * expected_speedup(alpha, k, c, verify_cost) / drafted,
    }


def _format_cell(value: Any, float_format: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return format(value, float_format)
    if isinstance(value, (list, tuple)):
        return ", ".join(_format_cell(v, float_format) for v in value)
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    float_format: str = ".2f",
) -> str:
    """A plain-text table of ``rows`` (dicts), one line per row.

    Columns are ``columns`` or every key in order of first appearance; a missing key is an
    empty cell. Floats use ``float_format``, lists are joined with ", " (per-position rates),
    numbers are right-aligned, everything else left-aligned.
    """
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_format_cell(row.get(col), float_format) for col in columns] for row in rows]
    numeric = [
        all(
            isinstance(row.get(col), (int, float)) and not isinstance(row.get(col), bool)
            for row in rows
            if row.get(col) is not None
        )
        for col in columns
    ]
    widths = [
        max([len(str(col))] + [len(line[i]) for line in cells]) for i, col in enumerate(columns)
    ]

    def render(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if is_num else v.ljust(w)
            for v, w, is_num in zip(values, widths, numeric)
        ).rstrip()

    lines = [render([str(c) for c in columns]), "  ".join("-" * w for w in widths)]
    lines += [render(line) for line in cells]
    return "\n".join(lines)


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    float_format: str = ".2f",
    file: TextIO | None = None,
) -> None:
    """Print ``format_table(rows, columns, float_format)`` to ``file`` (stdout)."""
    print(format_table(rows, columns, float_format), file=file if file is not None else sys.stdout)


def plot_acceptance_and_speedup(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], title: str | None = None
) -> None:
    """Draw per-position acceptance and speedup against k into an image file (PNG by suffix).

    Each row is one run: ``k`` (int), ``speedup`` (measured, float), ``acceptance_rate_per_pos``
    (list of k floats; missing or empty for a k = 0 baseline), optionally ``predicted_speedup``
    (drawn dashed) and ``label`` (the series it belongs to, e.g. ``"ngram / grounded"``). Left
    panel: acceptance rate against draft position, one line per row; right panel: speedup
    against k, one line per label.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(
            "plotting needs matplotlib: pip install 'verispec[plot]'"
        ) from e
    if not rows:
        raise ValueError("nothing to plot: rows is empty")
    # A Figure without pyplot: no global backend state, works headless.
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_accept, ax_speedup = fig.subplots(1, 2)
    series: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        series.setdefault(str(row.get("label", "")), []).append(row)
    for label, runs in series.items():
        runs = sorted(runs, key=lambda r: r["k"])
        for run in runs:
            rates = list(run.get("acceptance_rate_per_pos") or [])
            if not rates:  # e.g. the no-speculation baseline at k = 0
                continue
            name = f"{label} k={run['k']}" if label else f"k={run['k']}"
            ax_accept.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
        ks = [run["k"] for run in runs]
        line = ax_speedup.plot(ks, [run["speedup"] for run in runs], marker="o",
                               label=f"{label} measured" if label else "measured")[0]
        if any("predicted_speedup" in run for run in runs):
            predicted = [run.get("predicted_speedup", math.nan) for run in runs]
            ax_speedup.plot(ks, predicted, linestyle="--", marker="x", color=line.get_color(),
                            label=f"{label} predicted" if label else "predicted")
    ax_accept.set(xlabel="draft position", ylabel="acceptance rate (P(first i accepted))",
                  ylim=(0, 1.05), title="Per-position acceptance")
    ax_speedup.axhline(1.0, color="grey", linewidth=0.8)
    ax_speedup.set(xlabel="k (num_speculative_tokens)", ylabel="speedup vs no speculation",
                   title="Speedup")
    for ax in (ax_accept, ax_speedup):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(os.fspath(path), dpi=120)


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    disable: bool | None = None,
    file: TextIO | None = None,
) -> tqdm:
    """A progress bar for long runs (tqdm), on stderr and gone when done.

    Wrap an iterable (``for prompt in progress(prompts, desc="ngram k=3", unit="prompt")``) or
    make a counter to ``update`` (``bar = progress(total=num_tokens, unit="tok")``).
    ``disable=None`` shows the bar only on a terminal, so logs and CI output stay clean.
    """
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        disable=disable,
        leave=False,
        dynamic_ncols=True,
        file=file if file is not None else sys.stderr,
    )


def machine_description() -> str:
    """One line naming the hardware a benchmark ran on (STYLE: state the hardware)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [f"{cpu}, {os.cpu_count()} cores", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.insert(1, torch.cuda.get_device_name())
    return "; ".join(parts)


def print_host_profile(label: str, fn, rows: int = 20) -> None:
    """Run ``fn()`` under cProfile and print its ``rows`` costliest functions by their own
    time: what a step spends on the host (a device wait shows as a synchronize)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    # the engine's own functions by time spent in them and below: where a step's host time
    # goes, waits included
    stats.sort_stats("cumulative").print_stats("verispec", rows)
    print(f"host profile of {label}:")
    print("\n".join([line for line in text.getvalue().splitlines() if line.strip()][2:]))


def print_device_profile(label: str, fn, per: int, rows: int = 25) -> dict:
    """Run ``fn()`` under torch's profiler and print the ``rows`` costliest device kernels (CUDA
    graph replays included) in microseconds and launches per ``per`` units (decode steps,
    tokens), with the wall time and the kernels' summed time per unit: where the device's
    time goes, and how long it waits for the host. Returns the per-unit totals."""
    import time
    from collections import defaultdict

    import torch
    from torch.profiler import ProfilerActivity, profile

    totals, counts = defaultdict(float), defaultdict(int)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name[:70]] += event.device_time
            counts[event.name[:70]] += 1
    busy = sum(totals.values())
    table = [dict(kernel=name, launches=counts[name] / per, us=us / per, share=us / busy)
             for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]]
    print(f"device profile of {label}, per unit of {per}: wall {wall_us / per:.1f} us, kernels "
          f"{busy / per:.1f} us ({100 * busy / wall_us:.1f} % of the wall)")
    print_table(table)
    return dict(wall_us=wall_us / per, kernel_us=busy / per)
