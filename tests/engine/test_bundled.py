"""The engine on the bundled SmolLM2-135M-Instruct, against HF transformers ``generate``.

Strategy: float32 (bfloat16 near-ties flip greedy tokens), greedy, five chat prompts x 32
tokens, all five running together in our engine and each alone through HF ``generate``: the
tokens must be identical. One model load is shared by the session (``tests.models.utils``).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.utils import bundled_hf_model, bundled_llm, requires_bundled
from verispec import SamplingParams

pytestmark = [requires_bundled, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Add a docstring to: def add(a, b): return a + b",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
]


def test_greedy_matches_hf_generate():
    llm = bundled_llm()
    hf = bundled_hf_model()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=32))
    for out in outs:
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([out.prompt_token_ids]), max_new_tokens=32, do_sample=False,
                eos_token_id=sorted(llm.eos_token_ids), pad_token_id=2,
            )[0, len(out.prompt_token_ids):].tolist()
        assert out.token_ids == ref, (out.text, llm.tokenizer.decode(ref))
        assert out.finish_reason == ("stop" if ref[-1] in llm.eos_token_ids else "length")


def test_chat_output_is_text():
    llm = bundled_llm()
    out = llm.generate([{"role": "user", "content": "Say hello."}],
                       SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.text.strip() and "<|im_start|>" not in out.text
