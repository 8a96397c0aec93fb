"""The Python API under odd input (issue 48): each case once, on a tiny random model with the
bundled model's tokenizer and chat template.

Strategy: every refused input raises ValueError naming the field and the value, at the call
(never from inside transformers, never at the first ``next``); the edges of the engine API
(an idle ``step``, ``abort_request``, tensor prompts) behave as lists and arrays do; the length
rule is vLLM's and a text that proves itself too long is refused without being tokenized.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.models.utils import copy_bundled_tokenizer, requires_bundled, save_tiny_model
from verispec import LLM, SamplingParams
from verispec.engine import inputs

pytestmark = requires_bundled

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_edges")
    save_tiny_model(path, "LlamaForCausalLM", vocab_size=49152)
    copy_bundled_tokenizer(str(path))
    return LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2)


GREEDY = SamplingParams(temperature=0, max_tokens=4)


def test_lone_surrogates_are_value_errors_naming_the_prompt(llm):
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode: '\\ud800' at character 0"):
        llm.generate("\ud800 x", GREEDY)
    with pytest.raises(ValueError, match=r"messages\[1\]\.content is not valid Unicode"):
        llm.generate([{"role": "system", "content": "hi"},
                      {"role": "user", "content": "a \udfff"}], GREEDY)
    outs = llm.generate(["fine", "bad \ud800"], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error"]
    assert outs[1].error.startswith("prompt 1: prompt is not valid Unicode")


def test_limits_are_one_rule(llm):
    for params, quoted in ((dict(max_tokens=10 ** 9), "max_tokens=1000000000"),
                           (dict(max_tokens=MAX_MODEL_LEN), f"max_model_len={MAX_MODEL_LEN}")):
        with pytest.raises(ValueError, match=quoted):
            llm.generate("hi", SamplingParams(**params))
    with pytest.raises(ValueError, match=r"max_tokens must be an integer in \[1, 2\*\*63\)"):
        SamplingParams(max_tokens=2 ** 70)
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000000\] are outside"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10 ** 9]))
    with pytest.raises(ValueError, match=r"messages\[0\]\.role='wizard' is not a role the chat "
                                         r"template knows \(system, user, assistant\)"):
        llm.generate([{"role": "wizard", "content": "hi"}], GREEDY)


def test_a_text_that_proves_itself_too_long_is_not_tokenized(llm, monkeypatch):
    longest = llm.encoder.longest_token_chars
    assert longest is not None and longest > 1  # byte-level BPE, no normalizer
    huge = "word " * 2_000_000  # 10 MB

    def never(*args, **kwargs):
        raise AssertionError("tokenized a prompt its length already refused")

    monkeypatch.setattr(llm.tokenizer, "encode", never)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"prompt has 10000000 characters, so at least \d+ "
                                         r"tokens"):
        llm.generate(huge, GREEDY)
    assert time.perf_counter() - start < 0.5
    monkeypatch.undo()
    # At the bound the text is tokenized and judged by its tokens.
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens, but max_model_len"):
        llm.generate("x " * (MAX_MODEL_LEN * 2), GREEDY)


def test_engine_api_edges(llm):
    assert llm.step() == []  # nothing queued: nothing to do
    request = llm.add_request("The cat sat", GREEDY)
    llm.step()
    llm.abort_request(request)
    assert llm.get_output(request).finish_reason == "abort"
    assert not llm.has_unfinished_requests and llm.step() == []

    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate_stream("")  # at the call, not at the first next()
    unread = llm.generate_stream("never read", GREEDY)
    assert not llm.has_unfinished_requests  # an unread stream queues nothing
    del unread

    ids = [11, 12, 13]
    expected = llm.generate(ids, GREEDY)[0].token_ids
    assert llm.generate(torch.tensor(ids), GREEDY)[0].token_ids == expected
    assert llm.generate(np.array(ids), GREEDY)[0].token_ids == expected
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate(torch.tensor([1.0, 2.0]), GREEDY)


def test_chat_roles_come_from_the_template():
    class Tokenizer:
        chat_template = ("{% if message['role'] == 'tool' %}{% elif message.role == \"ipython\" "
                         "%}{% endif %}")

    assert inputs.chat_roles(Tokenizer()) == ("system", "user", "assistant", "tool", "ipython")
    assert inputs.chat_roles(None) == inputs.BASE_CHAT_ROLES
