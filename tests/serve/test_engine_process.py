"""The server's engine process: its life, its death and its start-up errors.

Strategy: a tiny random Llama (the bundled tokenizer) served with the engine in its own process,
as ``verispec serve`` runs it. The engine is killed (SIGKILL) while one streamed and one
non-streamed request run: both must end at once with an error naming the engine's death (an
error event, then ``[DONE]``; a 500), ``/health`` must turn 503 and new requests 503, and the
server must still stop cleanly, leaving no process. A bad engine argument must be the
ValueError ``LLM`` raises, from the API process, with no process left behind. An engine that
queues its steps ahead of the host (``async_scheduling``) serves concurrent requests the texts of
steps run in order.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal

import httpx
import pytest

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from tests.serve.utils import RunningServer
from verispec.serve import AsyncEngine

pytestmark = requires_bundled

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def engine_kwargs(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("tiny_llama_engine_process"))
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152,
                    max_position_embeddings=MAX_MODEL_LEN)
    copy_bundled_tokenizer(path)
    return dict(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2)


def test_a_dead_engine_fails_its_requests_and_health(engine_kwargs):
    server = RunningServer(engine_kwargs, "tiny")
    try:
        engine = server.engine
        assert engine.process.pid != os.getpid() and engine.process.is_alive()
        assert httpx.get(server.url + "/health").status_code == 200
        body = {"prompt": "The cat sat on the mat", "max_tokens": 200, "ignore_eos": True,
                "temperature": 1.0}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async with http.stream("POST", "/v1/completions",
                                       json=dict(body, stream=True)) as response:
                    lines = (line async for line in response.aiter_lines() if line)
                    for _ in range(2):  # it runs
                        assert (await anext(lines)).startswith("data: {")
                    pending = asyncio.ensure_future(http.post("/v1/completions", json=body))
                    await asyncio.sleep(0.2)
                    os.kill(engine.process.pid, signal.SIGKILL)
                    rest = [line async for line in lines]
                return rest, await pending

        rest, reply = asyncio.run(run())
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "engine process died" in error["message"] and error["type"] == "server_error"
        assert reply.status_code == 500 and "engine process died" in reply.json()["error"][
            "message"]
        assert httpx.get(server.url + "/health").status_code == 503
        refused = httpx.post(server.url + "/v1/completions", json=body)
        assert refused.status_code == 503
        assert "engine process died" in refused.json()["error"]["message"]
    finally:
        server.stop()
    assert engine.process not in multiprocessing.active_children()


def test_a_bad_engine_argument_is_llms_value_error(engine_kwargs):
    engine = AsyncEngine(dict(engine_kwargs, block_size=3))
    with pytest.raises(ValueError, match="block_size must be a power of two, got 3"):
        engine.start()
    assert not engine.process.is_alive()
    assert engine.process not in multiprocessing.active_children()


def test_an_async_scheduling_engine_serves_the_tokens_of_steps_in_order(engine_kwargs):
    """Concurrent streamed and whole completions through an engine process that queues its
    steps ahead of the host (``async_scheduling``) get the texts ``LLM.generate`` gives in
    order, and the server stops cleanly."""
    from verispec import LLM, SamplingParams

    prompts = ["The cat sat on the mat", "Once upon a time", "1, 2, 3,", "Dear reader"]
    expected = [o.text for o in LLM(**dict(engine_kwargs, max_num_seqs=4)).generate(
        prompts, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))]
    server = RunningServer(dict(engine_kwargs, max_num_seqs=4, async_scheduling=True), "tiny")
    try:
        async def one(http, prompt, stream):
            body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0.0}
            if not stream:
                reply = await http.post("/v1/completions", json=body)
                return reply.json()["choices"][0]["text"]
            text = ""
            async with http.stream("POST", "/v1/completions",
                                   json=dict(body, stream=True)) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                return await asyncio.gather(*(one(http, p, i % 2 == 0)
                                              for i, p in enumerate(prompts)))

        assert asyncio.run(run()) == expected
    finally:
        server.stop()
