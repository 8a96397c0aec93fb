"""A GGUF's tokenizer without transformers (``verispec.models.fast_tokenizer``).

Strategy: on the bundled model's cached directory, the fast tokenizer agrees with
transformers' on texts beyond its own probes (the benchmark prompt sets, random Unicode, random
ids) and on chat conversations; whatever it does not do itself goes to transformers' tokenizer;
a directory whose check failed (a chat template that differs) loads transformers' tokenizer
instead; a warm start of the bundled model imports no transformers at all.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys

import pytest

from tests.models.utils import requires_bundled
from verispec.bench.prompts import FREE_PROMPTS, GROUNDED_PROMPTS
from verispec.models import fast_tokenizer
from verispec.models import gguf as gguf_files
from verispec.models.loader import _load_hf_tokenizer, _load_tokenizer

pytestmark = requires_bundled


@pytest.fixture(scope="module")
def model_dir() -> str:
    return gguf_files.gguf_meta_dir(gguf_files.bundled_gguf_path())


@pytest.fixture(scope="module")
def hf(model_dir):
    return _load_hf_tokenizer(model_dir)


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = ("abcXYZ 019 \n\t.,;:!?'\"()[]{}<>|_-+=*/\\#@$%^&~`" "éüßçñøå" "日本語中文한국어"
                "🙂👍🏽🚀" "\u200b\u00a0")
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
            for _ in range(count)]


def test_agrees_with_transformers_beyond_its_probes(model_dir, hf):
    assert fast_tokenizer.verify(model_dir, hf)
    fast = fast_tokenizer.load(model_dir, _load_hf_tokenizer)
    assert isinstance(fast, fast_tokenizer.FastTokenizer)
    assert fast.eos_token_id == hf.eos_token_id and fast.get_vocab() == hf.get_vocab()
    texts = [*GROUNDED_PROMPTS, *FREE_PROMPTS, *random_texts(200, 0)]
    for text in texts:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            assert fast.decode(ids, skip_special_tokens=True) == hf.decode(
                ids, skip_special_tokens=True)
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(fast)) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    for text in texts[:20]:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        for prompt in (True, False):
            assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) \
                == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


def test_pickled_as_the_server_sends_it(model_dir, hf):
    fast = fast_tokenizer.FastTokenizer(model_dir, _load_hf_tokenizer)
    chat = [{"role": "user", "content": "Hi"}]
    text = fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    copy = pickle.loads(pickle.dumps(fast))
    assert copy._full is None  # still no transformers
    assert copy.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
    assert copy.encode(text) == fast.encode(text) and copy.eos_token_id == fast.eos_token_id


def test_the_rest_goes_to_transformers(model_dir, hf):
    fast = fast_tokenizer.FastTokenizer(model_dir, lambda _: hf)
    assert fast._full is None
    assert fast.convert_ids_to_tokens([1, 2, 500]) == hf.convert_ids_to_tokens([1, 2, 500])
    assert fast.pad_token_id == hf.pad_token_id and fast.hf_tokenizer is hf
    chat = [{"role": "user", "content": "hi", "name": "x"}]  # a field it does not render itself
    assert fast.apply_chat_template(chat, tokenize=False) == hf.apply_chat_template(
        chat, tokenize=False)
    assert fast.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        hf.apply_chat_template([{"role": "user", "content": "hi"}])  # tokenize=True


def test_a_directory_that_disagrees_keeps_transformers(model_dir, hf, tmp_path, monkeypatch):
    """A copy (in a cache of its own) whose chat template differs from what transformers'
    tokenizer renders: the check fails, the verdict says so, and loading gives transformers'
    tokenizer; without a verdict, loading checks and writes one."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    copy = tmp_path / "gguf" / "copy"
    shutil.copytree(model_dir, copy)
    (copy / fast_tokenizer.VERDICT_FILE).unlink(missing_ok=True)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert not fast_tokenizer.verify(str(copy), hf)
    assert json.loads((copy / fast_tokenizer.VERDICT_FILE).read_text())["agrees"] is False
    assert fast_tokenizer.load(str(copy), _load_hf_tokenizer) is None
    assert not isinstance(_load_tokenizer(str(copy)), fast_tokenizer.FastTokenizer)
    (copy / fast_tokenizer.VERDICT_FILE).unlink()  # no verdict yet: checked when loaded
    assert not isinstance(_load_tokenizer(str(copy)), fast_tokenizer.FastTokenizer)
    assert os.path.isfile(copy / fast_tokenizer.VERDICT_FILE)


def test_a_warm_start_imports_no_transformers(model_dir, hf):
    fast_tokenizer.verify(model_dir, hf)
    code = ("import sys; from verispec import LLM, SamplingParams; llm = LLM(); "
            "out = llm.generate([{'role': 'user', 'content': 'Hi'}], "
            "SamplingParams(temperature=0, max_tokens=4))[0]; "
            "print(len(out.token_ids), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.split()[-2:] == ["4", "False"]
