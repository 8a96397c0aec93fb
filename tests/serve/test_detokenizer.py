"""The API process's detokenizer and stop strings against the engine's own rules, without a model.

Strategy: the bundled model's tokenizer (byte-level BPE: incremental decoding applies) on token
sequences that stress the checkpoint rule: random ids from the whole vocabulary (byte tokens
that split UTF-8 characters, special tokens), and the tokens of multi-byte text. Every text the
incremental decoder gives must equal ``decode_output`` of the same prefix. Stop strings: a
``RequestState`` fed the tokens in random chunks (a speculative step delivers several) must
commit exactly the tokens, finish reason and text of a reference that applies ``LLM._commit``'s
rule token by token (an EOS / stop token first, then stop strings on the whole text so far, then
the length limit).
"""

from __future__ import annotations

import random

import pytest

from tests.models.utils import bundled_dir, requires_bundled
from verispec.engine.inputs import decode_output, find_stop_string
from verispec.models.loader import _load_tokenizer
from verispec.sampling_params import SamplingParams
from verispec.serve.detokenizer import Detokenizer, RequestState, decodes_incrementally

pytestmark = requires_bundled

TEXT = "héllo wörld, 日本語のテキスト 🙂🚀 naïve café — ok.\n\tend"


@pytest.fixture(scope="module")
def tokenizer():
    return _load_tokenizer(bundled_dir())


def sequences(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    special = list(tokenizer.all_special_ids)
    result = []
    for _ in range(count):
        ids = []
        while len(ids) < 60:
            kind = rng.random()
            if kind < 0.4:
                ids.append(rng.randrange(vocab))
            elif kind < 0.5:
                ids.append(rng.choice(special))
            else:
                start = rng.randrange(len(text_ids))
                ids += text_ids[start : start + rng.randint(1, 6)]
        result.append(ids)
    return result


def test_incremental_text_is_the_whole_decode(tokenizer):
    assert decodes_incrementally(tokenizer)
    rng = random.Random(1)
    for ids in sequences(tokenizer, 40):
        detokenizer = Detokenizer(tokenizer, incremental=True)
        n = 0
        while n < len(ids):
            n = min(len(ids), n + rng.randint(1, 4))
            assert detokenizer.text(ids, n) == decode_output(tokenizer, ids[:n]), (ids, n)
        assert detokenizer._num_checkpoint > 0  # the checkpoint moved: decoding was partial
        # Fewer tokens than the checkpoint (an EOS that is not text): the whole decode.
        assert detokenizer.text(ids, n - 1) == decode_output(tokenizer, ids[: n - 1])


def reference(tokenizer, ids: list[int], engine_finish: str | None, stop: list[str]):
    """(committed tokens, finish reason, text) by LLM's rule, token by token."""
    for n in range(1, len(ids) + 1):
        if n == len(ids) and engine_finish == "stop":
            return n, "stop", decode_output(tokenizer, ids[: n - 1])
        text = decode_output(tokenizer, ids[:n])
        index = find_stop_string(text, stop)
        if index is not None:
            return n, "stop", text[:index]
    return len(ids), engine_finish, decode_output(tokenizer, ids)


@pytest.mark.parametrize("stream", [True, False])
def test_stop_strings_commit_what_the_engine_would(tokenizer, stream):
    rng = random.Random(2)
    checked = {"stop": 0, "length": 0, "eos": 0}
    for case, ids in enumerate(sequences(tokenizer, 60, seed=3)):
        full = decode_output(tokenizer, ids)
        # Stop strings from the text itself (so they are hit, often across token boundaries),
        # and one that never is.
        stop = ["\x00never"]
        if full and case % 4:
            start = rng.randrange(len(full))
            stop.append(full[start : start + rng.randint(1, 4)])
        engine_finish = "stop" if case % 5 == 0 else "length"
        n_expected, finish, text = reference(tokenizer, ids, engine_finish, stop)
        if finish == "stop" and n_expected == len(ids) and engine_finish == "stop":
            checked["eos"] += 1
        else:
            checked[finish] += 1

        params = SamplingParams(stop=stop, max_tokens=len(ids), logprobs=0)
        state = RequestState(0, params, 5, tokenizer, incremental=True, stream=stream)
        shown = ""
        sent = 0
        while not state.finished:
            size = rng.randint(1, 4)
            chunk = ids[sent : sent + size]
            sent += len(chunk)
            last = sent >= len(ids)
            state.receive(chunk, [{t: -1.0} for t in chunk], engine_finish if last else None, 0)
            state.commit_stop_strings()
            output = state.output()
            assert output.text.startswith(shown)  # streamed text only grows
            shown = output.text
        assert (state.num_tokens, state.finish_reason, output.text) == (
            n_expected, finish, text), (ids, stop)
        assert output.num_text_tokens == n_expected - (
            finish == "stop" and engine_finish == "stop" and n_expected == len(ids))
        assert len(state.logprobs) >= state.num_tokens
        # Tokens the engine makes after a stop string are dropped.
        assert state.receive([5, 6], None, "length", 0) == 0 and state.num_tokens == n_expected
    assert min(checked.values()) > 0, checked


def test_without_stop_strings_tokens_commit_on_arrival(tokenizer):
    params = SamplingParams(max_tokens=4)
    state = RequestState(0, params, 3, tokenizer, incremental=True, stream=True)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)[:3]
    assert state.receive(ids[:2], None, None, 7) == 2 and not state.finished
    assert state.receive(ids[2:], None, "length", 7) == 1
    assert state.finish_reason == "length" and state.num_cached_tokens == 7
    assert state.output().text == decode_output(tokenizer, ids)
