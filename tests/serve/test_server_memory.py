"""The server over a deliberately tiny KV pool: many concurrent streaming clients all finish,
and ``/metrics`` shows the preemptions and the pool's use.

Strategy: a tiny random Llama with the bundled tokenizer behind ``verispec serve`` on 127.0.0.1,
16 request slots and a pool of one full-length request plus a few blocks, so that the scheduler
must preempt again and again; 100 streaming clients at once, seeded. Every stream must end with a
finish reason and the text ``LLM.generate`` gives that request alone; the preemption counter must
have grown and the KV-use gauge must be back at 0 once the server is idle.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from tests.serve.utils import RunningServer
from verispec import LLM, SamplingParams

openai = pytest.importorskip("openai")  # a test extra (pyproject): skip where absent
pytestmark = requires_bundled

MAX_MODEL_LEN = 128
BLOCK_SIZE = 4


def test_hundred_streams_on_a_tiny_pool_all_finish(tmp_path):
    path = str(tmp_path / "model")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152,
                    max_position_embeddings=MAX_MODEL_LEN)
    copy_bundled_tokenizer(path)
    common = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    oracle = LLM(path, max_num_seqs=16, **common)
    per_block = oracle.kv_plan.bytes_per_block
    blocks = 1 + MAX_MODEL_LEN // BLOCK_SIZE + 8
    server = RunningServer(dict(model=path, max_num_seqs=16,
                                kv_cache_memory=blocks * per_block, **common), "tiny")
    try:
        prompts = [f"Request {i}: the cat sat on the mat and" for i in range(100)]

        async def stream(api, i):
            text, reason = "", None
            response = await api.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=40, temperature=0.8, seed=i,
                stream=True, extra_body={"ignore_eos": True})
            async for chunk in response:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        async def run():
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                     max_retries=0, timeout=300)
            return await asyncio.gather(*[stream(api, i) for i in range(100)])

        results = asyncio.run(run())
        expected = oracle.generate(prompts, [SamplingParams(
            max_tokens=40, temperature=0.8, seed=i, ignore_eos=True) for i in range(100)])
        for (text, reason), out in zip(results, expected):
            assert reason == "length" and text == out.text
        after = server.wait_for(lambda m: m["vllm:num_requests_running"] == 0)
        assert after["vllm:num_preemptions_total"] > 0
        assert after["vllm:kv_cache_usage_perc"] == 0.0
    finally:
        server.stop()
