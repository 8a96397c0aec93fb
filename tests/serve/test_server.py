"""``verispec serve`` end to end: the real server on 127.0.0.1, the official ``openai`` client.

Strategy: a tiny random Llama (2 layers, vocab 49152, the bundled model's tokenizer and chat
template) served twice, with n-gram speculation and without, in float32, two KV slots each (so
a few concurrent requests already queue). Checks that hold for any weights:
- completions and chat, streamed and not, give exactly what ``LLM.generate`` gives for the same
  seed and parameters (an ``LLM`` built like the server's is the oracle);
- logprobs are those of the processed target distribution: greedy with speculation equals
  without it, and both equal HF transformers' log-softmax of the same positions; sampled tokens
  (temperature, top-k) with speculation equal HF's processed distribution too;
- bad fields are HTTP 400 naming field and value, an unknown model 404, while a stream beside
  them runs to the end unaffected;
- a client that disconnects (streaming or not) has its request aborted and its KV slot freed,
  read from ``/metrics``; a full server queues; the request counters add up to the usage the
  responses report; ``/metrics`` parses with prometheus_client and has vLLM's names.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from tests.serve.utils import RunningServer
from verispec import LLM, SamplingParams

openai = pytest.importorskip("openai")  # a test extra (pyproject): skip where absent
pytestmark = requires_bundled

MAX_MODEL_LEN = 2048
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
MODEL_NAME = "tiny-llama"
PROMPT = "The cat sat on the mat. The cat sat on the"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_serve")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152,
                    max_position_embeddings=MAX_MODEL_LEN)
    copy_bundled_tokenizer(str(path))
    return str(path)


def engine_kwargs(model_dir: str, speculative_config=None) -> dict:
    return dict(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
                speculative_config=speculative_config)


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
    """An LLM configured as the speculative server: seeded requests must match it."""
    return LLM(**engine_kwargs(model_dir, NGRAM))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def hf_logprobs(hf_model, prompt_ids, output_ids, temperature=1.0, top_k=0) -> torch.Tensor:
    """[len(output_ids)] log p(token) under HF's logits / temperature, top-k masked."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    rows = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)] / temperature
    if top_k:
        kth = rows.topk(top_k, dim=-1).values[:, -1:]
        rows = rows.masked_fill(rows < kth, float("-inf"))
    return torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def test_models_health_and_metric_names(spec_server, plain_server):
    assert [m.id for m in client(spec_server).models.list().data] == [MODEL_NAME]
    assert httpx.get(spec_server.url + "/health").status_code == 200
    names = {name.split("{")[0] for name in spec_server.metrics()}
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "verispec:kv_slots_in_use",
                 "vllm:kv_cache_usage_perc", "vllm:request_success_total",
                 "process_resident_memory_bytes"):
        assert name in names, name
    per_pos = [k for k in spec_server.metrics()
               if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert sorted(per_pos) == [f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"
                               for i in range(3)]
    # Without speculation there are no speculative metrics (as in vLLM).
    assert not any("spec_decode" in k for k in plain_server.metrics())


def test_completions_and_chat_equal_llm_generate(spec_server, oracle):
    api = client(spec_server)
    sampling = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=24)
    extra = {"top_k": 50, "min_p": 0.02}
    params = SamplingParams(**sampling, **extra)
    expected = oracle.generate(PROMPT, params)[0]
    assert expected.finish_reason == "length" and len(expected.token_ids) == 24

    result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=extra, **sampling)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 24
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)

    chunks = list(api.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                         extra_body=extra, **sampling))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"

    # A list of prompts is one choice per prompt, in order; token-id prompts work as text does.
    other = [5, 6, 7, 5, 6]
    both = api.completions.create(model=MODEL_NAME, prompt=[expected.prompt_token_ids, other],
                                  extra_body=extra, **sampling)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == expected.text
    assert both.choices[1].text == oracle.generate(other, params)[0].text

    # A stop string ends the text just before it, as in LLM.generate.
    stop = expected.text[len(expected.text) // 2:][:3]
    stopped = api.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=[stop],
                                     extra_body=extra, **sampling).choices[0]
    assert stopped.text == oracle.generate(PROMPT, SamplingParams(
        **sampling, **extra, stop=[stop]))[0].text
    assert stopped.finish_reason == "stop" and stop not in stopped.text

    chat_expected = oracle.generate(MESSAGES, params)[0]
    reply = api.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body=extra,
                                        **sampling)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == chat_expected.text
    assert reply.usage.prompt_tokens == len(chat_expected.prompt_token_ids)

    stream = list(api.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body=extra, **sampling))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        chat_expected.text)
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 24


def test_sampling_options_equal_llm_generate(spec_server, oracle):
    """OpenAI's penalties and logit_bias (string keys) and vLLM's extras reach the engine as
    SamplingParams fields: the text is LLM.generate's for the same seed."""
    api = client(spec_server)
    banned = oracle.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))[0]
    sampling = dict(temperature=0.7, seed=3, max_tokens=16, presence_penalty=0.5,
                    frequency_penalty=0.3, logit_bias={banned.token_ids[0]: -100})
    extra = {"repetition_penalty": 1.2, "min_tokens": 4, "bad_words": [" cat"]}
    expected = oracle.generate(PROMPT, SamplingParams(**sampling, **extra))[0]
    assert banned.token_ids[0] not in expected.token_ids
    result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=extra,
                                    **dict(sampling, logit_bias={str(banned.token_ids[0]): -100}))
    assert result.choices[0].text == expected.text
    reply = api.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, extra_body={"allowed_token_ids": [28, 29, 30]},
        temperature=0.0, max_tokens=5)
    assert reply.choices[0].message.content == oracle.generate(MESSAGES, SamplingParams(
        temperature=0.0, max_tokens=5, allowed_token_ids=[28, 29, 30]))[0].text


def test_one_token_requests_are_answered_whole(spec_server, oracle):
    """Regression: a request whose only step admitted and finished it (max_tokens=1: the
    engine's answer to the submission and the token come in one message) was answered with no
    token, its reader finding it finished before it first looked."""
    api = client(spec_server)
    expected = oracle.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))[0]
    for stream in (False, True):
        extra = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
        reply = api.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0.0,
                                       max_tokens=1, **extra)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            reply = chunks[-1]
        else:
            text, reason = reply.choices[0].text, reply.choices[0].finish_reason
        assert (text, reason, reply.usage.completion_tokens) == (expected.text, "length", 1)


def test_stop_strings_end_where_llm_generate_ends(spec_server, oracle):
    """Stop strings are checked in the API process on the engine's deltas (several tokens per
    step with speculation): the text, the finish reason and the token count (usage) are those
    of LLM.generate, streamed or not, for stop strings inside one token and across tokens."""
    api = client(spec_server)
    sampling = dict(temperature=0.9, seed=21, max_tokens=48)
    full = oracle.generate(PROMPT, SamplingParams(**sampling))[0]
    text = full.text
    assert len(text) > 40
    stops = [[text[5:6]], [text[12:16]], [text[30:33], text[20:24]], ["\x00never", text[-3:]]]
    for stop in stops:
        expected = oracle.generate(PROMPT, SamplingParams(**sampling, stop=stop))[0]
        assert expected.finish_reason == "stop", stop
        result = api.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=stop, **sampling)
        assert result.choices[0].text == expected.text, stop
        assert result.choices[0].finish_reason == "stop"
        assert result.usage.completion_tokens == len(expected.token_ids), stop
        chunks = list(api.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=stop,
                                             stream=True, stream_options={"include_usage": True},
                                             **sampling))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text, stop
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_logprobs_are_the_processed_target_distribution(spec_server, plain_server, oracle,
                                                        hf_model):
    """Greedy: speculative == plain logprobs (drafts were accepted on the way), both equal to HF's
    log-softmax. Sampled with temperature and top-k under speculation: HF's processed
    distribution at every position, including recovered and bonus tokens."""
    accepted_before = spec_server.metrics()["vllm:spec_decode_num_accepted_tokens_total"]
    greedy = dict(model=MODEL_NAME, prompt=PROMPT, temperature=0.0, max_tokens=32, logprobs=3)
    spec = client(spec_server).completions.create(**greedy).choices[0].logprobs
    plain = client(plain_server).completions.create(**greedy).choices[0].logprobs
    assert spec_server.metrics()["vllm:spec_decode_num_accepted_tokens_total"] > accepted_before
    assert spec.tokens == plain.tokens and len(spec.tokens) == 32
    assert spec.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-5)
    for spec_top, plain_top in zip(spec.top_logprobs, plain.top_logprobs):
        assert spec_top.keys() == plain_top.keys() and len(spec_top) == 3
        assert list(spec_top.values()) == pytest.approx(list(plain_top.values()), abs=1e-5)
    out = oracle.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert spec.tokens == [oracle.tokenizer.decode([t]) for t in out.token_ids]
    reference = hf_logprobs(hf_model, out.prompt_token_ids, out.token_ids)
    assert spec.token_logprobs == pytest.approx(reference.tolist(), abs=1e-4)

    sampled = dict(temperature=0.7, seed=11, max_tokens=32)
    reply = client(spec_server).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=2,
        extra_body={"top_k": 40}, **sampled)
    content = reply.choices[0].logprobs.content
    out = oracle.generate(MESSAGES, SamplingParams(top_k=40, **sampled))[0]
    assert reply.choices[0].message.content == out.text
    num_text = len(out.token_ids) - (out.finish_reason == "stop")  # an EOS is not text
    assert len(content) == num_text
    reference = hf_logprobs(hf_model, out.prompt_token_ids, out.token_ids[:num_text], 0.7, 40)
    assert [c.logprob for c in content] == pytest.approx(reference.tolist(), abs=1e-4)
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
        assert bytes(c.bytes).decode() == c.token


def expect_error(status, call, param, *quoted):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status
    error = info.value.body.get("error", info.value.body)
    assert error["param"] == param, error
    for text in quoted:
        assert text in error["message"], error


def test_bad_requests_are_openai_errors_and_others_run_on(spec_server, oracle):
    api = client(spec_server)
    params = dict(temperature=0.0, max_tokens=40, extra_body={"ignore_eos": True})
    expected = oracle.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40,
                                                      ignore_eos=True))[0].text
    stream = api.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **params)
    first = next(iter(stream)).choices[0].text  # running while the bad requests come in

    def complete(**fields):
        body = dict(model=MODEL_NAME, prompt="hi")
        body.update(fields)
        return lambda: api.completions.create(**body)

    expect_error(400, complete(temperature=-1), "temperature", "-1")
    expect_error(400, complete(top_p=1.5), "top_p", "1.5")
    expect_error(400, complete(extra_body={"top_k": -5}), "top_k", "-5")
    expect_error(400, complete(max_tokens=0), "max_tokens", "0")
    expect_error(400, complete(logprobs=50), "logprobs", "50")
    expect_error(400, complete(n=0), "n", "0")
    expect_error(400, complete(frequency_penalty=2.5), "frequency_penalty", "2.5")
    expect_error(400, complete(logit_bias={"x": 1}), "logit_bias", "'x'")
    expect_error(400, complete(logit_bias={"60000": 1}), "logit_bias", "60000")
    expect_error(400, complete(extra_body={"repetition_penalty": 0}), "repetition_penalty", "0")
    expect_error(400, complete(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens", "5")
    expect_error(400, complete(extra_body={"allowed_token_ids": [49152]}), "allowed_token_ids",
                 "49152")
    expect_error(400, complete(extra_body={"mirostat_tau": 5}), "mirostat_tau", "5")
    expect_error(400, complete(extra_body={"temperature": "hot"}), "temperature", "'hot'")
    expect_error(400, complete(extra_body={"stop_token_ids": [10 ** 6]}), "stop_token_ids",
                 "1000000")
    expect_error(400, complete(prompt=[1] * MAX_MODEL_LEN), "prompt", str(MAX_MODEL_LEN))
    expect_error(400, complete(prompt=""), "prompt", "empty")
    expect_error(400, complete(max_tokens=MAX_MODEL_LEN), "max_tokens", str(MAX_MODEL_LEN))
    expect_error(404, complete(model="gpt-4"), "model", "gpt-4")
    chat = api.chat.completions.create
    expect_error(400, lambda: chat(model=MODEL_NAME, messages=[]), "messages", "[]")
    expect_error(400, lambda: chat(model=MODEL_NAME, messages=MESSAGES, top_logprobs=2),
                 "top_logprobs", "logprobs")
    expect_error(400, lambda: chat(model=MODEL_NAME, messages=[{"role": "user"}]), "messages",
                 "'role': 'user'")
    raw = httpx.post(spec_server.url + "/v1/completions", content=b"{not json",
                     headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]

    assert first + "".join(c.choices[0].text for c in stream) == expected
    assert api.completions.create(model=MODEL_NAME, prompt=PROMPT, **params).choices[0].text == (
        expected)


def test_disconnect_aborts_and_frees_the_kv_slot(spec_server):
    """Streaming: the client reads three chunks of a long request, then closes the connection.
    Non-streaming: the client times out. Both requests are aborted (``finished_reason="abort"``)
    long before their max_tokens, and the KV slots come back."""
    before = spec_server.metrics()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1900, "temperature": 1.0,
            "ignore_eos": True}
    with httpx.Client(base_url=spec_server.url) as http:
        with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                line = next(line for line in lines if line.startswith("data: "))
                assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
            during = spec_server.metrics()
            assert during["verispec:kv_slots_in_use"] == 1
            assert during["vllm:num_requests_running"] == 1
        after = spec_server.wait_for(lambda m: m["verispec:kv_slots_in_use"] == 0)
        assert after["vllm:num_requests_running"] == 0
        abort = "vllm:request_success_total{finished_reason=abort}"
        assert after[abort] == before[abort] + 1
        generated = (after["vllm:generation_tokens_total"]
                     - before["vllm:generation_tokens_total"])
        assert 3 <= generated < 1900

        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.3)
        after = spec_server.wait_for(lambda m: m[abort] == before[abort] + 2)
        assert after["verispec:kv_slots_in_use"] == 0
    assert httpx.get(spec_server.url + "/health").status_code == 200


def test_full_server_queues_and_counters_add_up(spec_server, oracle):
    """Six concurrent requests on two KV slots: some wait, every one completes with the tokens
    LLM.generate gives it alone, and the request counters grow by the usage reported."""
    before = spec_server.metrics()
    seen_waiting = []

    async def run() -> list:
        api = openai.AsyncOpenAI(base_url=spec_server.url + "/v1", api_key="unused",
                                 max_retries=0)

        async def watch():
            async with httpx.AsyncClient() as http:
                while True:
                    text = (await http.get(spec_server.url + "/metrics")).text
                    line = next(x for x in text.splitlines()
                                if x.startswith("vllm:num_requests_waiting{"))
                    seen_waiting.append(float(line.split()[-1]))
                    await asyncio.sleep(0.01)

        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*[
            api.completions.create(model=MODEL_NAME, prompt=f"{PROMPT} {i}", temperature=1.0,
                                   seed=100 + i, max_tokens=60, extra_body={"ignore_eos": True})
            for i in range(6)])
        watcher.cancel()
        return results

    results = asyncio.run(run())
    for i, result in enumerate(results):
        expected = oracle.generate(f"{PROMPT} {i}", SamplingParams(
            temperature=1.0, seed=100 + i, max_tokens=60, ignore_eos=True))[0]
        assert result.choices[0].text == expected.text
    assert max(seen_waiting) >= 1
    after = spec_server.wait_for(lambda m: m["vllm:num_requests_running"] == 0)
    assert after["verispec:kv_slots_in_use"] == 0 and after["vllm:num_requests_waiting"] == 0

    def grew(name):
        return after[name] - before[name]

    assert grew("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in results)
    assert grew("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert grew("vllm:request_success_total{finished_reason=length}") == 6
    assert grew("vllm:time_to_first_token_seconds_count") == 6
    assert grew("vllm:e2e_request_latency_seconds_count") == 6
    assert grew("vllm:inter_token_latency_seconds_count") > 0


def test_second_chat_turn_reports_cached_tokens_and_matches_a_cold_server(plain_server,
                                                                          model_dir):
    """Prefix caching through the server: a second chat turn whose messages extend the first
    (the first turn's messages, the assistant's answer, a new user message) finds the first
    turn's prompt in the prefix cache, so its usage reports
    ``prompt_tokens_details.cached_tokens`` > 0 (in the response and in the streamed usage
    chunk), and, greedy, it answers exactly what a fresh server given the second turn alone
    answers."""
    api = client(plain_server)
    first = [{"role": "system", "content": "You answer in one short line. " * 8},
             {"role": "user", "content": "Name three colours."}]
    greedy = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    answer = api.chat.completions.create(model=MODEL_NAME, messages=first, **greedy)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "And three animals?"}]
    warm = api.chat.completions.create(model=MODEL_NAME, messages=second, **greedy)
    streamed = list(api.chat.completions.create(model=MODEL_NAME, messages=second, stream=True,
                                                stream_options={"include_usage": True},
                                                **greedy))
    cold_server = RunningServer(engine_kwargs(model_dir), MODEL_NAME)
    try:
        cold = client(cold_server).chat.completions.create(model=MODEL_NAME, messages=second,
                                                           **greedy)
    finally:
        cold_server.stop()
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        cold.choices[0].message.content)
    # vLLM's counters, in tokens
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for family in text_string_to_metric_families(
        httpx.get(plain_server.url + "/metrics").text) for s in family.samples}
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert samples["vllm:prefix_cache_hits_total"] >= 2 * cached  # the two warm requests
    assert samples["vllm:prefix_cache_queries_total"] > samples["vllm:prefix_cache_hits_total"]


def test_serve_flags_are_checked_before_the_model_loads(capsys):
    from verispec import cli

    args = cli.build_parser().parse_args(["serve", "--port", "9001", "--host", "0.0.0.0"])
    assert (args.port, args.host, args.served_model_name) == (9001, "0.0.0.0", None)
    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535], got 70000" in capsys.readouterr().err
    assert cli.main(["serve", "--max-request-bytes", "0"]) == 2
    assert "--max-request-bytes must be an integer >= 1, got 0" in capsys.readouterr().err
