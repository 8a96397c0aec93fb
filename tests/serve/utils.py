"""Running a real ``verispec serve`` app on 127.0.0.1: uvicorn in a thread of the test process,
the engine in its own process (as ``verispec serve`` runs it)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from verispec.serve import AsyncEngine, build_app


class RunningServer:
    """uvicorn serving ``build_app`` over an engine process built from ``engine_kwargs``
    (``LLM``'s arguments) on a free port until ``stop``, which leaves no process behind."""

    def __init__(self, engine_kwargs: dict, model_name: str, **app_kwargs) -> None:
        self.model_name = model_name
        self.engine = AsyncEngine(engine_kwargs)
        self.engine.start()
        self.app = build_app(self.engine, model_name, **app_kwargs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # the kernel picks a free port, and we hold it
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()  # a no-op after the app's shut-down stopped it
        assert not self.engine.process.is_alive(), "the engine process outlived its server"

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed by prometheus_client: sample name (with labels other than
        model_name, as ``name{label=value}``) -> value."""
        text = httpx.get(self.url + "/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                if s.name.startswith(("vllm:", "verispec:")):
                    assert s.labels.get("model_name") == self.model_name, s
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                                + "}" if labels else "")
                samples[key] = s.value
        return samples

    def wait_for(self, condition, timeout_s: float = 15.0) -> dict[str, float]:
        """Poll ``/metrics`` until ``condition(samples)``; returns the samples."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            if condition(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never satisfied the condition: {samples}")
            time.sleep(0.02)
