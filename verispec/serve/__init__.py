"""``verispec serve``: an OpenAI-compatible HTTP server with vLLM's Prometheus metrics.

``build_app(AsyncEngine(engine_kwargs), model_name)`` gives the FastAPI app
(``verispec.serve.app``). The engine runs in a process of its own (``verispec.serve.engine_core``),
talking to this one over ``verispec.serve.channel``; how requests join, leave and are aborted,
and how their tokens become text, are in ``verispec.serve.async_engine`` and
``verispec.serve.detokenizer``.
"""

from verispec.serve.app import build_app, default_model_name, run_server
from verispec.serve.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app", "default_model_name", "run_server"]
