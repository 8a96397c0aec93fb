"""The OpenAI-compatible HTTP server: FastAPI routes in this process, the engine in its own.

    POST /v1/completions        text or token-id prompts (a list of them gives one choice each)
    POST /v1/chat/completions   messages, the model's chat template applied
    GET  /v1/models             the served model
    GET  /health                200 while the engine process runs (503 once it died)
    GET  /metrics               Prometheus text, vLLM's metric names (verispec.serve.metrics)

Two processes (docs/architecture.md, The server): this one (uvicorn, the routes, tokenizing,
detokenizing, streaming; ``verispec.serve.async_engine``) and the engine process (``LLM`` and
its step loop; ``verispec.serve.engine_core``), which only steps and sends each step's new
tokens. The step loop and the HTTP side never share a GIL, so the server keeps up with the
engine and ``/health`` answers within milliseconds under load.

Errors are OpenAI's error body: a bad field 400 naming the field and the value (text that is
not valid Unicode included), an unknown model 404, an unknown route 404, a body over
``--max-request-bytes`` 413, an unexpected exception 500 (its traceback logged; the connection
stays usable); a request's error never touches the requests running beside it. A client that
disconnects at any point is an INFO line, never an error.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from starlette.exceptions import HTTPException

from verispec.config import SpeculativeConfig
from verispec.models import gguf
from verispec.serve.async_engine import AsyncEngine
from verispec.serve.engine_core import LOG_FORMAT
from verispec.serve.metrics import ServerMetrics
from verispec.serve.middleware import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from verispec.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from verispec.serve.serving import OpenAIServing

logger = logging.getLogger("verispec.serve")

SWITCH_INTERVAL_S = 0.0005


def default_model_name(model: str | None) -> str:
    """The name clients send as ``model``: the ``--model`` value as given (vLLM's default), or
    the bundled model's name."""
    if model is not None:
        return model
    return os.path.basename(gguf.bundled_gguf_path()).split(".")[0]


def build_app(engine: AsyncEngine, model_name: str,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The app serving ``engine``'s model as ``model_name`` (``engine`` is started here if it
    was not: this loads the model). The app's lifespan connects the engine at start-up and
    stops its process at shut-down. ``app.state`` holds ``engine``, ``serving`` and
    ``metrics`` (its own Prometheus registry).
    Request bodies over ``max_request_bytes`` are refused (413) before they are parsed."""
    info = engine.info if engine.info is not None else engine.start()
    metrics = ServerMetrics(model_name, info.max_num_seqs, info.num_speculative_tokens)
    serving = OpenAIServing(engine, model_name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.connect(metrics)
        try:
            yield
        finally:
            await engine.close()
            serving.shutdown()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(list(exc.errors()), exc.body).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return ApiError(exc.status_code,
                        f"{request.method} {request.url.path}: {exc.detail}").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "verispec",
                "root": model_name, "max_model_len": info.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    return app


def run_server(engine_kwargs: dict, speculative_config: SpeculativeConfig | None, host: str,
               port: int, served_model_name: str | None = None,
               max_request_bytes: int | None = None) -> int:
    """Start the engine process (the model loads before the server listens: a bad argument is
    a ValueError here) and serve it until interrupted (uvicorn handles Ctrl-C and SIGTERM; the
    engine process is stopped with the server)."""
    disable_created_metrics()  # no ``*_created`` series in this process, as in vLLM
    # The tokenizer thread holds the GIL while it tokenizes a long prompt; the event loop would
    # wait up to the switch interval (5 ms by default) each time it wants it back.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    engine = AsyncEngine(dict(engine_kwargs, speculative_config=speculative_config))
    info = engine.start()
    try:
        name = served_model_name or default_model_name(engine_kwargs.get("model"))
        logger.info("serving %r (%s, max_num_seqs=%d; engine process %d) on http://%s:%d/v1",
                    name, info.description, info.max_num_seqs, engine.process.pid, host, port)
        app = build_app(engine, name, max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.shutdown()  # a no-op after the app's shut-down; else (uvicorn failed) stop it
    return 0
