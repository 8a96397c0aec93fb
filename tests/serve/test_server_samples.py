"""The server's ``n``, ``echo`` and prompt logprobs, through the official ``openai`` client.

Strategy: the tiny random Llama of ``test_server`` served with n-gram speculation and without.
- ``response_format`` (json_schema, json_object) and ``structured_outputs`` (choice, regex):
  the JSON parses and validates against the schema, for each of n choices; a schema the engine
  cannot compile is a 400 naming the field.
- ``n`` samples come back as ``choices`` with ``index`` 0..n-1 per prompt (prompt i's at
  i n + j), sample j equal to ``LLM.generate`` with ``seed + j``, streamed and not.
- The request lm-evaluation-harness sends for a loglikelihood task (``--model
  local-completions``: token-id prompts, ``echo``, ``logprobs=1``, ``max_tokens=1``,
  temperature 0) returns the prompt's token logprobs (None first) equal with and without
  speculation and equal to HF transformers' log-softmax; ``max_tokens=0`` returns the prompt
  alone. Its generate-until request (token-id prompts in one list, ``stop``, greedy) gives
  each prompt's ``LLM.generate`` text, in prompt order.
- ``best_of`` (completions) returns the ``n`` samples ``LLM.generate`` returns for the same
  ``best_of``, ``n`` and seed (the most likely first), without logprobs unless asked; ``best_of``
  < ``n`` and ``best_of`` > ``n`` with ``stream`` are 400s naming ``best_of``.
"""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest
import torch

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from tests.serve.test_server import (
    MAX_MODEL_LEN,
    MESSAGES,
    MODEL_NAME,
    NGRAM,
    PROMPT,
    client,
    engine_kwargs,
)
from tests.serve.utils import RunningServer
from verispec import LLM, SamplingParams

jsonschema = pytest.importorskip("jsonschema")  # a test extra (pyproject): skip where absent
pytestmark = requires_bundled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_samples")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152,
                    max_position_embeddings=MAX_MODEL_LEN)
    copy_bundled_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def spec_server(model_dir):
    server = RunningServer(engine_kwargs(model_dir, NGRAM), MODEL_NAME)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_server(model_dir):
    server = RunningServer(engine_kwargs(model_dir), MODEL_NAME)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle(model_dir):
    return LLM(**engine_kwargs(model_dir, NGRAM))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_n_choices_are_the_seeded_samples(spec_server, oracle):
    api = client(spec_server)
    prompts = [PROMPT, "Once upon a time"]
    response = api.completions.create(model=MODEL_NAME, prompt=prompts, n=3, seed=11,
                                      max_tokens=8, temperature=0.8)
    assert [c.index for c in response.choices] == list(range(6))
    for c in response.choices:
        want = oracle.generate(prompts[c.index // 3], SamplingParams(
            temperature=0.8, seed=11 + c.index % 3, max_tokens=8))[0]
        assert c.text == want.text
    stream = api.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, seed=11, max_tokens=8,
                                    temperature=0.8, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in response.choices[:2]]
    chat = api.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, seed=3,
                                       max_tokens=6)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == sum(
        len(oracle.generate(MESSAGES, SamplingParams(seed=3 + j, max_tokens=6))[0].token_ids)
        for j in range(2))


def loglikelihood_request(ids: list[list[int]]) -> dict:
    """What lm-evaluation-harness's local-completions model posts for loglikelihood."""
    return {"model": MODEL_NAME, "prompt": ids, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}


def test_echo_logprobs_as_lm_eval_sends_them(spec_server, plain_server, oracle, hf_model):
    tokenizer = oracle.tokenizer
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in (PROMPT, "Paris is in France")]
    answers = []
    for server in (spec_server, plain_server):
        response = httpx.post(server.url + "/v1/completions", json=loglikelihood_request(ids),
                              timeout=60)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    spec, plain = answers
    for i, (a, b) in enumerate(zip(spec["choices"], plain["choices"])):
        lp = a["logprobs"]
        assert a["index"] == i and len(lp["tokens"]) == len(ids[i]) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        # lm-eval: sum(token_logprobs[ctxlen:-1]), greedy iff each equals max(top_logprobs)
        assert lp["token_logprobs"][:-1] == b["logprobs"]["token_logprobs"][:-1]
        assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
        assert a["text"].startswith(tokenizer.decode(ids[i]))
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids[i]])).logits[0].float()
        want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[i][1:])[:, None])
        for got, w in zip(lp["token_logprobs"][1:-1], want[:, 0].tolist()):
            assert math.isclose(got, w, abs_tol=1e-4)
    api = client(plain_server)
    only = api.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=0,
                                  logprobs=2)
    choice = only.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(tokenizer.encode(PROMPT))
    assert choice.logprobs.text_offset[1] == len(choice.logprobs.tokens[0])
    assert only.usage.completion_tokens == 0
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=3, temperature=0, stream=True))
    plain_text = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                        temperature=0).choices[0].text
    assert streamed == PROMPT + plain_text


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"enum": ["Ann", "Bob"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def test_response_format_and_structured_outputs(spec_server):
    api = client(spec_server)
    chat = api.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=40, seed=5,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = api.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40,
                                         response_format={"type": "json_object"}, stream=True,
                                         temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text.startswith("{")
    done = api.completions.create(model=MODEL_NAME, prompt="Pick:", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert done.choices[0].text in ("red", "blue")
    done = api.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=10,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]"}})
    assert re.fullmatch("[A-Z]{2}[0-9]", done.choices[0].text)
    bad = [({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "a(b"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "response_format", "give one")]
    for fields, param, text in bad:
        response = httpx.post(spec_server.url + "/v1/chat/completions", timeout=60,
                              json=dict(model=MODEL_NAME, messages=MESSAGES, **fields))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and text in error["message"], error


def test_generate_until_as_lm_eval_sends_it(spec_server, oracle):
    tokenizer = oracle.tokenizer
    texts = ["Q: What is 2 plus 2?\nA:", PROMPT, "Q: What colour is snow?\nA:"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    response = httpx.post(spec_server.url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 16, "temperature": 0,
        "stop": ["\n"], "seed": 1234})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c, prompt in zip(choices, ids):
        want = oracle.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=16, stop=["\n"], seed=1234))[0]
        assert c["text"] == want.text and "\n" not in c["text"]


def test_best_of_returns_the_best_samples(spec_server, oracle):
    api = client(spec_server)
    common = dict(max_tokens=8, temperature=0.9, seed=11)
    response = api.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Once upon a time"],
                                      n=2, best_of=4, **common)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate([PROMPT, "Once upon a time"]):
        want = oracle.generate(prompt, SamplingParams(n=2, best_of=4, **common))[0].outputs
        got = response.choices[2 * p: 2 * p + 2]
        assert [c.text for c in got] == [o.text for o in want]
        assert all(c.logprobs is None for c in got)
    assert response.usage.completion_tokens == sum(len(o.token_ids) for prompt in [
        PROMPT, "Once upon a time"] for o in oracle.generate(prompt, SamplingParams(
            n=4, **common))[0].outputs)
    asked = api.completions.create(model=MODEL_NAME, prompt=PROMPT, n=1, best_of=3, logprobs=1,
                                   **common)
    assert len(asked.choices) == 1 and len(asked.choices[0].logprobs.tokens) > 0
    for fields, text in (({"n": 3, "best_of": 2}, "best_of must be"),
                         ({"best_of": 2, "stream": True}, "cannot be streamed")):
        response = httpx.post(spec_server.url + "/v1/completions", timeout=60,
                              json=dict(model=MODEL_NAME, prompt=PROMPT, **fields))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "best_of" and text in error["message"], error

