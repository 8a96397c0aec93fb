"""The server under hostile and odd input (issue 48), small enough for CI.

Strategy: a tiny random Llama with the bundled tokenizer served on 127.0.0.1 (max_model_len 256,
two KV slots, a 1 MiB request limit), every log record of the process captured. Driven with raw
sockets by the helpers of ``benchmarks/bench_server_robustness.py`` (whose full-size run, 1000
requests and 10 MB prompts on the bundled model, docs/benchmarks.md records):
- the hostile corpus (huge, deeply nested, wrong content types, invalid Unicode, negative and
  enormous numbers, unknown fields, 10 MB prompts) and hypothesis over the request schema:
  every answer is JSON with the expected status;
- an unexpected exception is a JSON 500 with its traceback logged, on a connection that serves
  the next request;
- a disconnect storm (streaming and not, at every point): no ERROR or WARNING record, every KV
  slot free, the same server still answering;
- /health and a running stream while 10 MB prompts are refused.
Each test ends with a normal request that must work.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import logging
import pathlib

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from tests.serve.utils import RunningServer

pytestmark = requires_bundled

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_server_robustness.py"
MAX_REQUEST_BYTES = 1 << 20


def load_script():
    spec = importlib.util.spec_from_file_location("bench_server_robustness", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_script()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def bad(self) -> list[str]:
        return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in self.records
                if r.levelno >= logging.WARNING]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_hostile")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152, max_position_embeddings=256)
    copy_bundled_tokenizer(str(path))
    running = RunningServer(dict(model=str(path), dtype="float32", max_model_len=256,
                                 max_num_seqs=2), "tiny", max_request_bytes=MAX_REQUEST_BYTES)
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("", "verispec", "uvicorn", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    running.records = handler
    yield running
    for logger in loggers:
        logger.removeHandler(handler)
    running.stop()


def normal_request_works(server) -> None:
    reply = httpx.post(server.url + "/v1/completions", json={
        "prompt": bench.PROMPT, "max_tokens": 3, "temperature": 0.0}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert server.thread.is_alive()


def test_hostile_corpus_is_answered_with_json(server):
    corpus = bench.hostile_corpus(MAX_REQUEST_BYTES, prompt_bytes=MAX_REQUEST_BYTES - 200)
    rows = asyncio.run(bench.run_corpus("127.0.0.1", server.port, corpus))
    assert [r["name"] for r in rows if not r["ok"]] == [], rows
    by_name = {r["name"]: r for r in rows}
    assert by_name["over max_request_bytes"]["status"] == 413
    assert by_name["10 MB prompt"]["status"] == 400  # refused by its length, not tokenized
    normal_request_works(server)


@pytest.mark.parametrize("body, param, quoted", [
    ({"prompt": "\ud800 x"}, "prompt", "'\\ud800'"),
    ({"prompt": "hi", "stop": ["ok", "\udc00"]}, "stop", "stop[1]"),
    ({"prompt": "hi", "max_tokens": 10 ** 9}, "max_tokens", "max_model_len=256"),
    ({"prompt": "hi", "stop_token_ids": [10 ** 9]}, "stop_token_ids", "1000000000"),
    ({"prompt": ["fine", "x" * 30_000]}, "prompt", "prompt[1]"),
])
def test_bad_fields_are_400_naming_them(server, body, param, quoted):
    payload = json.dumps(body).encode()  # json.dumps escapes lone surrogates as \ud800
    reply = httpx.post(server.url + "/v1/completions", content=payload,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and quoted in error["message"], error


def test_chat_roles_are_checked(server):
    reply = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "wizard", "content": "hi"}]})
    assert reply.status_code == 400
    assert "messages[0].role='wizard'" in reply.json()["error"]["message"]


def test_unexpected_exception_is_a_json_500_on_a_usable_connection(server, monkeypatch):
    serving = server.app.state.serving

    def broken(name):
        raise RuntimeError("a bug")

    monkeypatch.setattr(serving, "check_model", broken)
    before = len(server.records.records)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 500
    error = json.loads(reply.read())["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    logged = [r for r in server.records.records[before:] if r.levelno == logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None  # the traceback
    server.records.records[before:] = []
    monkeypatch.undo()
    sock = conn.sock
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and json.loads(reply.read())["object"] == "text_completion"
    assert conn.sock is sock  # the same connection
    conn.close()


_text = st.text(max_size=40)  # includes lone surrogates
_number = st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True),
                    st.none(), st.booleans(), _text)
_fields = {
    "prompt": st.one_of(_text, st.lists(st.integers(-5, 60_000), max_size=8),
                        st.lists(_text, max_size=3), st.integers()),
    "max_tokens": st.one_of(st.integers(-3, 3), _number),
    "temperature": st.one_of(st.floats(0, 2), _number),
    "top_p": _number, "top_k": _number, "min_p": _number, "seed": _number,
    "stop": st.one_of(_text, st.lists(_text, max_size=3), _number),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 2 ** 65), max_size=3), _number),
    "logprobs": st.one_of(st.integers(-2, 30), _number),
    "stream": st.one_of(st.booleans(), _number),
    "ignore_eos": st.booleans(),
    "n": st.one_of(st.integers(0, 3), _number),
    "wizardry": _number,
}


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({}, optional=_fields))
def test_fuzzed_completion_bodies_get_json_answers(server, body):
    payload = json.dumps(body, allow_nan=True).encode()
    reply = httpx.post(server.url + "/v1/completions", content=payload, timeout=60,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code in (200, 400), (body, reply.status_code, reply.text[:300])
    if reply.status_code == 400:
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    elif body.get("stream") is True:
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "choices" in json.loads(event)
    else:
        assert reply.json()["object"] == "text_completion"


def test_disconnect_storm_leaves_no_error_and_no_slot(server):
    server.records.records.clear()
    counts = asyncio.run(bench.run_storm("127.0.0.1", server.port, num_requests=80,
                                         num_clients=16, seed=1, max_tokens=12))
    assert sum(counts.values()) == 80
    assert {key.split(":")[1] for key in counts} >= set(bench.STREAM_MODES)
    idle = asyncio.run(bench.wait_idle("127.0.0.1", server.port))
    assert idle["verispec:kv_slots_in_use"] == 0 and idle["vllm:num_requests_running"] == 0
    assert server.records.bad() == []
    disconnected = [r for r in server.records.records if "disconnected" in r.getMessage()]
    assert disconnected and all(r.levelno == logging.INFO for r in disconnected)
    normal_request_works(server)


def test_health_and_a_stream_while_huge_prompts_are_refused(server):
    """The strict goals (p99 <= 50 ms, worst gap <= 3x the median) are the benchmark's, on the
    bundled model; here, with a model whose steps take ~1 ms, bounds a stall would break."""
    result = asyncio.run(bench.latency_under_huge_prompts(
        "127.0.0.1", server.port, MAX_REQUEST_BYTES - 200, num_huge=3, max_tokens=150))
    assert result["huge_statuses"] == [400, 400, 400]
    assert result["health_p99_ms"] < 250, result
    assert result["gap_max_ms"] < 500, result
    normal_request_works(server)


_message = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["system", "user", "assistant", "wizard", ""]), _number),
    "content": st.one_of(_text, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": _text}), max_size=2), _number),
    "name": _text,
})


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({"messages": st.one_of(st.lists(_message, max_size=3),
                                                         _number)}, optional={
    "max_tokens": st.one_of(st.integers(-3, 3), _number),
    "max_completion_tokens": st.one_of(st.integers(-3, 3), _number),
    "logprobs": st.one_of(st.booleans(), _number),
    "top_logprobs": st.one_of(st.integers(-2, 30), _number),
    "stream": st.booleans(),
}))
def test_fuzzed_chat_bodies_get_json_answers(server, body):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       content=json.dumps(body, allow_nan=True).encode(),
                       headers={"Content-Type": "application/json"})
    assert reply.status_code in (200, 400), (body, reply.status_code, reply.text[:300])
    if reply.status_code == 400:
        assert reply.json()["error"]["message"]
    elif not body.get("stream"):
        assert reply.json()["object"] == "chat.completion"
