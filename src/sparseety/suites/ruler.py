"""RULER-style long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated locally from the license prose under
``/usr/share/common-licenses/`` (the passkey haystack) and deterministic for a seed.

Tasks (RULER's names in brackets; the wording of needles, questions and answer prefixes is RULER's):

``niah_single`` [niah_single_2]
    One needle ``"One of the special magic numbers for {key} is: {value}."`` (a hyphenated word key,
    a 7-digit value) in the prose; asked for that key's number.
``niah_multikey`` [niah_multikey_1]
    Four such needles with four different keys; asked for one key (the other three are distractors).
``niah_multivalue`` [niah_multivalue]
    Four needles of one key with four different values; all four must be recalled.
``vt`` [vt: variable tracking, one chain of four hops]
    ``"VAR ABCDE = 12345."`` then ``"VAR FGHIJ = VAR ABCDE."`` ... spread in order through the prose;
    asked which variables are assigned the value (all five names).
``cwe`` [cwe: common words extraction]
    A numbered list of words from the licenses' vocabulary: ten words appear often (6 times each below
    4,096 tokens, 30 above), the rest rarely (once below 4,096 tokens, 3 times above); asked for the ten.

Scoring is RULER's string-match recall (``string_match_all``): the fraction of the expected items found in
the answer, case-insensitively, here as whole words (a 7-digit value inside a longer number, or ``law``
inside ``lawful``, does not count).

A case is a pure function of ``(task, length, index, seed)``; ``index`` picks the needle's depth from a
low-discrepancy sequence (0.5, 0.16, 0.71, 0.37, 0.92, ...), so ``--cases 3`` is a prefix of ``--cases 5``.
The context starts with the task's instruction (RULER puts it there too) and is compressed with the prose;
the question and the answer prefix are fed uncompressed.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from sparseety.suites.passkey import corpus_sentences, take_sentences, word_count
from sparseety.errors import ConfigError, InputError

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")

#: answer length limit per task (RULER generates 128 / 30 / 120; these fit the answers here)
MAX_NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 32, "cwe": 48}

NIAH_PREAMBLE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the numbers afterwards.")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text."
CWE_PREAMBLE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.")

NIAH_NEEDLES = 4  #: needles of niah_multikey (one asked) and values of niah_multivalue
VT_HOPS = 4  #: a chain of VT_HOPS + 1 variables
CWE_COMMON = 10

_ADJECTIVES = (
    "able", "acid", "aged", "amber", "ancient", "bitter", "bold", "brave", "brief", "bright", "broad", "calm",
    "clever", "coastal", "crisp", "curious", "damp", "dark", "eager", "early", "elegant", "faint", "fancy", "fierce",
    "gentle", "giant", "glossy", "golden", "grand", "happy", "hollow", "honest", "humble", "icy", "jolly", "keen",
    "lively", "lucky", "mellow", "misty", "modern", "narrow", "noble", "odd", "pale", "polite", "proud", "quiet",
    "rapid", "rare", "rustic", "salty", "shiny", "silent", "sleepy", "smooth", "solid", "spicy", "steep", "sunny",
    "swift", "tidy", "timid", "vivid", "wild", "witty", "young", "zealous",
)
_NOUNS = (
    "anchor", "apple", "arrow", "badger", "basket", "beacon", "bicycle", "blanket", "bottle", "bridge", "candle",
    "canyon", "castle", "cellar", "cherry", "compass", "cottage", "dolphin", "dragon", "engine", "falcon", "feather",
    "forest", "fountain", "garden", "glacier", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern",
    "meadow", "mirror", "monkey", "needle", "oyster", "paddle", "parrot", "pepper", "pillow", "planet", "pocket",
    "puzzle", "rabbit", "ribbon", "river", "rocket", "saddle", "shadow", "spider", "sponge", "squirrel", "statue",
    "teapot", "thimble", "ticket", "tiger", "tunnel", "turtle", "umbrella", "valley", "violin", "wagon", "walrus",
    "window", "zipper",
)


@dataclass(frozen=True)
class RulerCase:
    """One generated case.

    ``inserts`` are the sentences placed into the prose (needles, chain statements), in context order,
    and ``insert_tokens`` where each starts in the context (``count_tokens`` units of the text before it);
    ``depth`` is where the asked needle sits as a fraction of the prose's tokens (None for ``cwe``).
    """

    task: str
    length: int
    index: int
    seed: int
    context: str
    question: str
    answer_prefix: str
    expected: tuple[str, ...]
    inserts: tuple[str, ...]
    insert_tokens: tuple[int, ...]
    context_tokens: int
    depth: float | None
    max_new_tokens: int

    def to_dict(self, with_context: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"task": self.task, "length": self.length, "index": self.index, "seed": self.seed,
                               "question": self.question, "answer_prefix": self.answer_prefix,
                               "expected": list(self.expected), "inserts": list(self.inserts),
                               "insert_tokens": list(self.insert_tokens), "context_tokens": self.context_tokens,
                               "depth": self.depth}
        if with_context:
            out["context"] = self.context
        return out


def case_rng(task: str, seed: int, length: int, index: int) -> random.Random:
    """The random stream of one case: depends only on the task, seed, length and index."""
    return random.Random(f"ruler:{task}:{seed}:{length}:{index}")


def case_depth(index: int) -> float:
    """The asked needle's depth for case ``index``: a golden-ratio sequence in [0.05, 0.95], 0.5 first."""
    return round(0.05 + 0.9 * ((0.5 + index * 0.6180339887498949) % 1.0), 2)


@functools.lru_cache(maxsize=2)
def corpus_words() -> tuple[str, ...]:
    """Distinct lowercase alphabetic words of 4 to 12 letters in the license text, sorted."""
    words = {w.lower() for s in corpus_sentences() for w in re.findall(r"[A-Za-z]+", s) if 4 <= len(w) <= 12}
    return tuple(sorted(words))


def make_ruler_case(task: str, length: int, index: int = 0, seed: int = 0,
                    count_tokens: Callable[[str], int] = word_count) -> RulerCase:
    """Build case ``index`` of ``task`` with a context of about ``length`` tokens.

    Parameters
    ----------
    task : one of :data:`TASKS`.
    length : target context length in ``count_tokens`` units (the instruction included).
    index : which case (its depth and random stream).
    seed : the case is a pure function of ``(task, length, index, seed)``.
    count_tokens : tokens in a text; pass the model tokenizer's counter for token-exact lengths.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown RULER task {task!r}; valid tasks: {', '.join(TASKS)}")
    if length < 200:
        raise ConfigError(f"RULER length must be at least 200 tokens, got {length} (task {task})")
    if index < 0:
        raise ConfigError(f"case index must be >= 0, got {index}")
    rng = case_rng(task, seed, length, index)
    build = {"niah_single": _niah, "niah_multikey": _niah, "niah_multivalue": _niah, "vt": _vt, "cwe": _cwe}[task]
    return build(task, length, index, seed, rng, count_tokens)


def make_ruler_cases(tasks: list[str], lengths: list[int], cases: int, seed: int = 0,
                     count_tokens: Callable[[str], int] = word_count) -> list[RulerCase]:
    """``cases`` cases of every task at every length: tasks outer, then lengths, then index."""
    return [make_ruler_case(t, n, i, seed, count_tokens) for t in tasks for n in lengths for i in range(cases)]


# -- the generators ------------------------------------------------------------------------------------

def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], count)
    return [f"{a}-{n}" for a, n in pairs]


def _numbers(rng: random.Random, count: int, low: int, high: int) -> list[str]:
    return [str(v) for v in rng.sample(range(low, high + 1), count)]


def _niah(task: str, length: int, index: int, seed: int, rng: random.Random,
          count_tokens: Callable[[str], int]) -> RulerCase:
    many = task != "niah_single"
    keys = _keys(rng, NIAH_NEEDLES if task == "niah_multikey" else 1)
    values = _numbers(rng, NIAH_NEEDLES if many else 1, 1_000_000, 9_999_999)
    if task == "niah_multivalue":
        needles = [NIAH_NEEDLE.format(key=keys[0], value=v) for v in values]
        asked, expected = keys[0], tuple(values)
    else:
        needles = [NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        asked, expected = keys[0], (values[0],)
    if task == "niah_multivalue":
        question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
        prefix = f"The special magic numbers for {asked} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {asked} mentioned in the provided text?"
        prefix = f"The special magic number for {asked} mentioned in the provided text is"
    depth = case_depth(index)
    # the asked needle (the first) at ``depth``, the others at random sentence boundaries
    return _in_prose(task, length, index, seed, rng, count_tokens, NIAH_PREAMBLE, needles, question, prefix,
                     expected, ordered=False, depth=depth)


def _vt(task: str, length: int, index: int, seed: int, rng: random.Random,
        count_tokens: Callable[[str], int]) -> RulerCase:
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = _numbers(rng, 1, 10_000, 99_999)[0]
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
              f"are assigned the value {value}, they are:")
    depth = case_depth(index)
    return _in_prose(task, length, index, seed, rng, count_tokens, VT_PREAMBLE, statements, question, prefix,
                     tuple(names), ordered=True, depth=depth)


def _in_prose(task: str, length: int, index: int, seed: int, rng: random.Random, count_tokens: Callable[[str], int],
              preamble: str, inserts: list[str], question: str, prefix: str, expected: tuple[str, ...], *,
              ordered: bool, depth: float) -> RulerCase:
    """Prose of about ``length`` tokens (the preamble and inserts counted) with each insert at a sentence
    boundary: the first at ``depth`` of the prose's tokens, the others at random boundaries (after the first,
    in order, when ``ordered``, so a chain reads in order)."""
    sentences = corpus_sentences()
    used = count_tokens(preamble) + sum(count_tokens(" " + s) for s in inserts)
    chosen, sizes = take_sentences(rng.randrange(len(sentences)), length, count_tokens, used)
    before = [0, *accumulate(sizes)]  # prose tokens before each boundary
    first = min(range(len(before)), key=lambda k: (abs(before[k] - depth * before[-1]), k))
    others = [rng.randint(first if ordered else 0, len(chosen)) for _ in inserts[1:]]
    boundaries = [first, *(sorted(others) if ordered else others)]
    slots: list[list[str]] = [[] for _ in range(len(chosen) + 1)]
    for cut, text in zip(boundaries, inserts):
        slots[cut].append(text)
    parts = [preamble]
    for k in range(len(chosen) + 1):
        parts.extend(slots[k])
        if k < len(chosen):
            parts.append(chosen[k])
    context = " ".join(parts)
    placed, starts, offset = [], [], 0
    for text in (t for k in range(len(chosen) + 1) for t in slots[k]):
        at = context.index(text, offset)
        placed.append(text)
        starts.append(count_tokens(context[:at].rstrip()))
        offset = at + len(text)
    return RulerCase(task=task, length=length, index=index, seed=seed, context=context, question=question,
                     answer_prefix=prefix, expected=expected, inserts=tuple(placed), insert_tokens=tuple(starts),
                     context_tokens=count_tokens(context), depth=depth, max_new_tokens=MAX_NEW_TOKENS[task])


def _cwe(task: str, length: int, index: int, seed: int, rng: random.Random,
         count_tokens: Callable[[str], int]) -> RulerCase:
    freq_common, freq_rare = (6, 1) if length < 4096 else (30, 3)
    vocabulary = list(corpus_words())
    rng.shuffle(vocabulary)
    common, rare_pool = vocabulary[:CWE_COMMON], vocabulary[CWE_COMMON:]

    def context_of(rare: int) -> str:
        words = common * freq_common + rare_pool[:rare] * freq_rare
        random.Random(f"ruler:cwe-order:{seed}:{length}:{index}:{rare}").shuffle(words)
        return CWE_PREAMBLE + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    low, high = 0, len(rare_pool)
    if count_tokens(context_of(high)) < length:
        raise InputError(f"cwe: the license vocabulary ({len(vocabulary)} words) cannot fill {length} tokens")
    while low < high:  # the most rare words that keep the context within the length
        mid = (low + high + 1) // 2
        if count_tokens(context_of(mid)) <= length:
            low = mid
        else:
            high = mid - 1
    context = context_of(low)
    question = f"Question: What are the {CWE_COMMON} most common words in the above list?"
    prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
    return RulerCase(task=task, length=length, index=index, seed=seed, context=context, question=question,
                     answer_prefix=prefix, expected=tuple(common), inserts=(), insert_tokens=(),
                     context_tokens=count_tokens(context), depth=None, max_new_tokens=MAX_NEW_TOKENS[task])


# -- scoring and encoding ----------------------------------------------------------------------------------

def _found(item: str, text: str) -> bool:
    pattern = rf"(?<![A-Za-z0-9]){re.escape(item)}(?![A-Za-z0-9])"
    if re.search(pattern, text, re.IGNORECASE):
        return True
    joined = re.sub(r"(?<=\d)[,\s](?=\d)", "", text)  # 1,234,567 and 1 234 567 read as 1234567
    return bool(re.search(pattern, joined, re.IGNORECASE))


def score(expected: tuple[str, ...] | list[str], answer: str) -> float:
    """RULER's recall: the fraction of ``expected`` found in ``answer`` (whole words, any case)."""
    if not expected:
        raise InputError("a RULER case expects at least one item")
    return sum(_found(item, answer) for item in expected) / len(expected)


def encode_case(tokenizer: Any, case: RulerCase, chat: bool | None) -> Any:
    """The long-document encoding of ``case``: context (compressed) | question + answer prefix (not).

    With a chat template the user turn is ``context + "\\n\\n" + question`` and the answer prefix starts the
    assistant turn; without one (a base model) the text is ``context + "\\n\\n" + question + " " + prefix``
    (:func:`sparseety.engine.inputs.encode_with_answer_prefix`, which ``bench passkey`` uses for base models).
    """
    from sparseety.engine.inputs import encode_with_answer_prefix

    return encode_with_answer_prefix(tokenizer, case.context, case.question, case.answer_prefix, chat)
