"""Stress of the Triton rejection op on a GPU: no launch may hang, whatever runs beside it.

No program of the rejection kernels waits for another (docs/architecture.md): a program that
needs other programs' results is the last of them to count, or runs in the next launch. This
test runs the op thousands of times while a second stream keeps the GPU busy with matrix
multiplications (so the op's programs are scheduled in whatever order the hardware picks,
between another kernel's blocks), eagerly and replayed from a CUDA graph, every rule and several
batch sizes, and checks every output against the first output for those inputs and that against
the torch twin. It runs in a child process with a time limit, so a hang is a failure, not a
stuck test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
TIME_LIMIT_S = 240

STRESS = textwrap.dedent("""
    import time
    import torch
    from verispec.ops import rejection, triton_ops

    K, V = 4, 128256
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def batch(b):
        logits = torch.randn(b * (K + 1), V, device=dev, generator=gen)
        drafts = torch.randint(0, V, (b * K,), device=dev, generator=gen)
        rows = torch.arange(b * K, device=dev)
        rows = rows + rows // K
        logits[rows, drafts] = torch.logsumexp(logits[rows], -1) + 1.4  # p(d) ~ 0.8
        q = torch.softmax(logits[rows] + torch.randn(b * K, V, device=dev, generator=gen), -1)
        return (logits, drafts, torch.arange(b + 1, device=dev) * K, q,
                (torch.arange(b, device=dev) % 4 != 3).float(), None, None, None,
                torch.randint(0, 2**62, (b,), device=dev, generator=gen),
                torch.randint(0, 4096, (b,), device=dev, generator=gen), K)

    configs = []
    for b in (1, 8, 32, 64, 128):
        args = batch(b)
        for rule in ("one-hot", "full"):
            a = args if rule == "full" else args[:3] + (None,) + args[4:]
            expected = rejection.rejection_sample(*a)
            first = triton_ops.rejection_sample(*a, check_draft_ids=False)
            assert torch.equal(expected, first), (b, rule)
            configs.append((a, first))
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    def busy(n):
        with torch.cuda.stream(side):
            for _ in range(n):
                torch.mm(x, x)

    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    t0 = time.time()
    calls = 0
    for it in range(400):
        if it % 20 == 0:
            busy(40)
        for a, first in configs:
            out = triton_ops.rejection_sample(*a, check_draft_ids=False)
            mismatches += (out != first).any()
            calls += 1
    torch.cuda.synchronize()
    eager_s = time.time() - t0

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a, first in configs:  # a first call of each kind on the capturing stream
            triton_ops.rejection_sample(*a, check_draft_ids=False)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        outs = [triton_ops.rejection_sample(*a, check_draft_ids=False) for a, _ in configs]
    t0 = time.time()
    replays = 0
    for it in range(300):
        if it % 20 == 0:
            busy(40)
        graph.replay()
        replays += 1
        for out, (_, first) in zip(outs, configs):
            mismatches += (out != first).any()
    torch.cuda.synchronize()
    graph_s = time.time() - t0
    print(f"eager calls {calls} ({eager_s:.1f} s), graph replays {replays} of {len(outs)} calls "
          f"({graph_s:.1f} s), mismatches {int(mismatches)}")
    assert int(mismatches) == 0
""")


@pytest.mark.gpu
def test_many_launches_beside_another_stream_never_hang(device):
    """Thousands of launches beside a busy second stream, eager and in a CUDA graph: every one
    ends (the child process finishes within the time limit) with the twin's tokens."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        done = subprocess.run([sys.executable, "-c", STRESS], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the stress run did not finish in {TIME_LIMIT_S} s (a hang?): "
                    f"{(exc.stdout or b'')[-2000:]!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    print(done.stdout.strip())
