"""``verispec serve`` in a subprocess for the serving benchmark: start it on a free port, read its
``/metrics`` and RSS, stop it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 1200  # an 8B target's load and CUDA-graph capture fit well within it


def read_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as sample name (labels but model_name appended) -> value."""
    text = httpx.get(base_url + "/metrics", trust_env=False).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def mean_acceptance_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    """1 + accepted / drafts between two ``read_metrics`` (None: nothing was drafted)."""
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = grew("vllm:spec_decode_num_drafts_total")
    return 1 + grew("vllm:spec_decode_num_accepted_tokens_total") / drafts if drafts else None


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``verispec serve <flags>`` on a free local port, its output in ``log_path``; ready (its
    ``/health`` answers) when the constructor returns."""

    def __init__(self, flags: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(self.port),
                   *flags]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(f"verispec serve exited ({self.process.returncode}); see "
                                   f"{log_path}")
            try:
                if httpx.get(self.url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"verispec serve did not start in {START_TIMEOUT_S} s; see "
                                   f"{log_path}")
            time.sleep(0.5)
        served = httpx.get(self.url + "/v1/models", trust_env=False).json()["data"][0]
        self.model: str = served["id"]
        self.max_model_len: int = served["max_model_len"]

    @property
    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
