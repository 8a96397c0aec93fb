"""``verispec serve``: an OpenAI-compatible HTTP server with vLLM's Prometheus metrics.

``build_app(llm, model_name)`` gives the FastAPI app (``verispec.serve.app``); the engine thread
and how requests join, leave and are aborted are in ``verispec.serve.async_engine``.
"""

from verispec.serve.app import build_app, default_model_name, run_server
from verispec.serve.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app", "default_model_name", "run_server"]
