"""Prompt sets for ``verispec bench``: built-in sets, JSONL files and random token ids.

Two built-in text sets, because prompt lookup pays only where the output copies the input:

- ``grounded``: the answer reuses the prompt's text (edit this code and return it, summarise or
  rewrite this passage). n-gram drafts are accepted often.
- ``free``: open-ended stories and questions. Little to copy; speculation must not cost here.

A JSONL file holds one object per line with either a ``"prompt"`` string or a
``"prompt_token_ids"`` list (other keys are ignored); blank lines are skipped. Token-id prompts
and ``RandomPrompts`` (ids drawn uniformly from the model's vocabulary) need no tokenizer.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

# A bench prompt: text, or token ids.
Prompt = str | list[int]

_MOVING_AVERAGE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result'''

_PARSE_CONFIG = '''def parse_config(text):
    settings = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {line_number}: expected key = value")
        key, value = line.split("=", 1)
        settings[key.strip()] = value.strip()
    return settings'''

_BINARY_SEARCH = '''def find(xs, t):
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        m = (lo + hi) // 2
        if xs[m] == t:
            return m
        if xs[m] < t:
            lo = m + 1
        else:
            hi = m - 1
    return -1'''

_STACK = '''class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        return self._items[-1] if self._items else None

    def __len__(self):
        return len(self._items)'''

_CHUNKS = '''def chunks(items, size):
    out = []
    for start in range(0, len(items) - size, size):
        out.append(items[start:start + size])
    return out'''

_WORD_COUNT_JS = '''function wordCounts(text) {
  const counts = new Map();
  for (const word of text.toLowerCase().split(/\\W+/)) {
    if (word.length === 0) continue;
    counts.set(word, (counts.get(word) || 0) + 1);
  }
  return [...counts.entries()].sort((a, b) => b[1] - a[1]);
}'''

_TIDES = (
    "Tides are the regular rise and fall of the sea surface, caused mainly by the Moon's "
    "gravity and, to a lesser degree, the Sun's. The Moon pulls hardest on the side of the Earth "
    "facing it, so the water there bulges toward the Moon; on the far side the Earth itself is "
    "pulled away from the water, which leaves a second bulge. As the Earth turns beneath these "
    "two bulges, most coasts see two high tides and two low tides a little more than a day "
    "apart. When the Sun and Moon line up, at new and full moon, their pulls add and the range "
    "between high and low water is largest; these are spring tides. When they are at right "
    "angles, at the quarter moons, the range is smallest; these are neap tides. The shape of a "
    "coastline and the depth of the sea floor can amplify the range enormously, which is why "
    "some narrow bays see the water rise by more than ten metres."
)

_BREAD = (
    "Bread rises because of yeast, a single-celled fungus that feeds on the sugars in flour. As "
    "it feeds it releases carbon dioxide and a little alcohol. Kneading develops gluten, a "
    "network of proteins that makes the dough stretchy enough to trap the gas in small bubbles, "
    "so the dough swells instead of letting the gas escape. A warm kitchen speeds the yeast up "
    "and a cold one slows it down, which is why some bakers leave dough in the refrigerator "
    "overnight to develop more flavour. In the oven the trapped gas expands, the yeast dies, "
    "the alcohol evaporates and the starches and proteins set, fixing the bubbles in place as "
    "the crumb of the finished loaf."
)

_MEETING = (
    "Notes from the Tuesday planning meeting. Present: Ana, Ben, Chloe, David. Ana reported "
    "that the new checkout page is finished but the payment provider's test account expires on "
    "Friday, so testing must be done by Thursday. Ben said the mobile app crash affects about "
    "two percent of users on older phones; he thinks a memory leak in the image cache is the "
    "cause and will have a fix ready next week. Chloe asked for two more days for the "
    "accessibility review because the colour contrast of the buttons fails the guidelines. "
    "David agreed to move the release from the 12th to the 14th. Action items: Ana tests "
    "payments by Thursday, Ben fixes the image cache leak, Chloe finishes the accessibility "
    "review, David tells the support team about the new release date."
)

_EMAIL = (
    "hi team, so basically the server thing from yesterday is fixed now i think, it was the "
    "disk getting full because the logs were never deleted, i added a job that deletes logs "
    "older than two weeks and it runs every night at 3am. if you see anything weird let me "
    "know. also the backup from monday didnt run because of the same problem so i ran it by "
    "hand this morning and it finished ok. thanks"
)

GROUNDED_PROMPTS: tuple[str, ...] = (
    f"Add a docstring to this function and return the code.\n\n{_MOVING_AVERAGE}",
    f"Add type hints to this function and return the complete code.\n\n{_PARSE_CONFIG}",
    "Rename the variables of this function to descriptive names (xs -> sorted_values, t -> "
    f"target, m -> middle) and return the code.\n\n{_BINARY_SEARCH}",
    f"Add a docstring to the class and to each method, then return the code.\n\n{_STACK}",
    "This function drops the last chunk when the length is a multiple of the size. Fix the bug "
    f"and return the corrected code.\n\n{_CHUNKS}",
    f"Add a comment above each line of this JavaScript function and return it.\n\n{_WORD_COUNT_JS}",
    f"Summarise the following text in three sentences.\n\n{_TIDES}",
    f"Summarise the following text for a ten-year-old.\n\n{_BREAD}",
    f"List the decisions and action items from these meeting notes.\n\n{_MEETING}",
    "Rewrite this email with correct capitalisation and punctuation, keeping its wording.\n\n"
    f"{_EMAIL}",
)

FREE_PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue.",
    "What are three good ways to learn a new language as an adult?",
    "Write a poem about the first cold morning of autumn.",
    "Describe a day in the life of a blacksmith in a medieval village.",
    "What is the difference between a virus and a bacterium?",
    "Invent a board game for four players and explain its rules.",
    "Write a letter from a cat to its owner about the new dog.",
    "Why do people dream? Describe a few of the main theories.",
    "Tell a story about a robot that wants to learn to paint.",
)

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "grounded": GROUNDED_PROMPTS,
    "free": FREE_PROMPTS,
}


def prompt_set_names() -> list[str]:
    """Names of the built-in prompt sets."""
    return sorted(PROMPT_SETS)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def load_jsonl_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """Prompts from a JSONL file: one ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``
    object per line (text, or token ids; a file may mix them).

    Blank lines are skipped and other keys ignored. A line that is not a JSON object with exactly
    one of a non-empty ``"prompt"`` string and a non-empty ``"prompt_token_ids"`` list of
    integers >= 0 raises ValueError naming the file and the line; a file with no prompt raises
    ValueError too. Token ids are checked against the vocabulary once the model is loaded.
    """
    path = Path(path)
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({e.msg})") from None
            record = record if isinstance(record, dict) else {}
            text, ids = record.get("prompt"), record.get("prompt_token_ids")
            if isinstance(text, str) and text and ids is None:
                prompts.append(text)
            elif _is_token_ids(ids) and text is None:
                prompts.append(list(ids))
            else:
                raise ValueError(
                    f'{path}:{line_number}: expected an object with a non-empty "prompt" string '
                    'or a non-empty "prompt_token_ids" list of integers >= 0 (not both), got '
                    f"{line.strip()[:80]!r}"
                )
    if not prompts:
        raise ValueError(
            f'{path}: no prompts (expected one {{"prompt": ...}} or {{"prompt_token_ids": ...}} '
            "object per line)"
        )
    return prompts


def get_prompts(source: str | os.PathLike[str]) -> list[Prompt]:
    """A built-in set by name (``grounded``, ``free``) or the prompts of a JSONL file."""
    if isinstance(source, str) and source in PROMPT_SETS:
        return list(PROMPT_SETS[source])
    if not Path(source).is_file():
        raise ValueError(
            f"prompts must be a built-in set {prompt_set_names()} or a JSONL file, "
            f"got {str(source)!r} (no such file)"
        )
    return load_jsonl_prompts(source)


@dataclass(frozen=True)
class RandomPrompts:
    """``num_prompts`` prompts of ``prompt_len`` token ids drawn uniformly from [0, vocab_size).

    The vocabulary size is the model's, so the ids are drawn (``token_ids``) once it is loaded.
    Seeded: the same fields and vocabulary give the same prompts. No tokenizer is needed.
    """

    num_prompts: int = 10
    prompt_len: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "prompt_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def token_ids(self, vocab_size: int) -> list[list[int]]:
        """The prompts: ``num_prompts`` lists of ``prompt_len`` ids in [0, vocab_size)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        rng = random.Random(self.seed)
        return [[rng.randrange(vocab_size) for _ in range(self.prompt_len)]
                for _ in range(self.num_prompts)]
