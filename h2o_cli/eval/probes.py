"""Synthetic retrieval probes: a filler text with one fact planted in it, and a question asking for the fact.

A probe varies what the passkey grid (`eval/passkey.py`) keeps fixed: the filler (a public-domain novel, or a
list of random words), the needle's wording, the value's type (a number, a word, a UUID) and the question's
wording. Two disjoint sets are drawn from it:

- `TUNING`: what `h2o calibrate` finds a model's lead head on (three novels and random word lists; its own
  needle and question wordings; numbers, words and UUIDs);
- `REPORT`: what the lead head is measured on (three other novels; other wordings; numbers).

Neither uses the Paul Graham essays the grid reads. Each set is a list of wordings and fillers; `probe` draws
one probe of a set from a seed.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from pathlib import Path

# Short, common words: random word lists, and the values of word needles.
WORDS = (
    "apple river candle garden silver window mountain pencil orange forest basket thunder marble violet "
    "lantern harbor copper meadow pillow rocket saddle tiger velvet walnut anchor bottle castle dragon "
    "engine falcon glacier hammer island jacket kettle ladder magnet needle oyster pepper quartz ribbon "
    "salmon tunnel umbrella valley wagon yogurt zebra button cactus dolphin feather ginger helmet igloo "
    "jungle koala lemon mirror nutmeg olive parrot quilt raven spider tomato unicorn vessel whistle "
    "bridge cabin desert ember fossil goblet hollow iris jewel kernel lily mango north orbit prism "
    "quiver rose summit tulip urchin vine willow yarn zephyr amber breeze cobalt dune echo fern grove"
).split()


@dataclass(frozen=True)
class ProbeSet:
    """Fillers (novels' file names in the data folder's `gutenberg_books`, or `WORD_LIST`), needle and
    question wordings (`{value}` and `{kind}`: the value and what it is called), and the value types."""

    name: str
    books: tuple[str, ...]
    needles: tuple[str, ...]
    questions: tuple[str, ...]
    kinds: tuple[str, ...]  # of "number", "word", "uuid"
    word_lists: bool


KIND_NAMES = {"number": "number", "word": "word", "uuid": "code"}

TUNING = ProbeSet(
    "tuning",
    ("frankenstein_pg84.txt", "pride_and_prejudice_pg1342.txt", "tale_of_two_cities_pg98.txt"),
    (
        "\nThe special {kind} is {value}. Keep the {kind} {value} in mind.\n",
        "\nNote well: the hidden {kind} for today is {value}.\n",
        "\nImportant: remember that the secret {kind} is {value}. The secret {kind} is {value}.\n",
    ),
    (
        "What is the special {kind}? Reply with the {kind} only.",
        "Which hidden {kind} was mentioned in the text? Give only the {kind}.",
        "Tell me the secret {kind} from the text, nothing else.",
    ),
    ("number", "word", "uuid"),
    True,
)

REPORT = ProbeSet(
    "report",
    ("moby_dick_pg2701.txt", "sherlock_holmes_pg1661.txt", "war_and_peace_pg2600.txt"),
    (
        "\nThe access key is {value}. Write it down: {value} is the access key.\n",
        "\nA reminder for later: the code you will need is {value}.\n",
    ),
    (
        "What is the access key? Answer with the key only.",
        "What code will you need? Reply with the code and nothing else.",
    ),
    ("number",),  # a UUID: the embedded model does not copy one even inside its window
    False,
)

WORD_LIST = "random words"


@dataclass(frozen=True)
class Probe:
    """One probe: `text` (the filler with the needle planted at `depth` %), `question`, and `value`, the
    answer a correct reply contains; `needle` is the planted sentence, `filler` where the text came from."""

    text: str
    question: str
    value: str
    needle: str
    depth: int
    filler: str
    kind: str


def value_of(kind: str, rng: random.Random) -> str:
    """A fresh value of `kind`: a 5-7 digit number, a word of `WORDS`, or a UUID."""
    if kind == "number":
        return str(rng.randint(10_000, 9_999_999))
    if kind == "word":
        return rng.choice(WORDS)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def word_list(rng: random.Random, words: int) -> str:
    """`words` random words of `WORDS`, in sentences of 6-14 words."""
    out = []
    while len(out) < words:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        out.append(" ".join(sentence).capitalize() + ".")
        words -= len(sentence) - 1
    return " ".join(out)


def book_text(folder: Path | None, name: str) -> str | None:
    """The novel `name` of the data folder's `gutenberg_books` (its Project Gutenberg header and licence cut
    off), or None where it is missing."""
    if folder is None or not (folder / "gutenberg_books" / name).is_file():
        return None
    text = (folder / "gutenberg_books" / name).read_text(encoding="utf-8", errors="replace")
    start, end = text.find("*** START"), text.find("*** END")
    if start >= 0:
        text = text[text.find("\n", start) + 1 :]
    return text[: end - start] if 0 <= start < end else text


def fillers(probe_set: ProbeSet, data: Path | None) -> list[tuple[str, str]]:
    """(name, text) of every filler of `probe_set` found: its novels in `data` (a data folder, or None), and
    its random word lists (made per probe: text ""). At least one: the word lists when no novel is found."""
    found = [(name, text) for name in probe_set.books if (text := book_text(data, name))]
    if probe_set.word_lists or not found:
        found.append((WORD_LIST, ""))
    return found


def probe(
    tokenizer, probe_set: ProbeSet, filler: tuple[str, str], tokens: int, depth: int, seed: int
) -> Probe:
    """One probe of `probe_set` from `seed`: about `tokens` tokens of `filler` (from an offset the seed picks;
    word lists made from the seed) with a needle of a seeded wording and value type planted at the sentence
    end nearest before `depth` %, and a seeded question wording."""
    rng = random.Random(seed)
    kind = rng.choice(probe_set.kinds)
    value = value_of(kind, rng)
    named = KIND_NAMES[kind]
    needle = rng.choice(probe_set.needles).format(value=value, kind=named)
    question = rng.choice(probe_set.questions).format(kind=named)
    name, text = filler
    room = max(16, tokens - len(tokenizer(needle, add_special_tokens=False)["input_ids"]))
    if not text:
        context = word_list(rng, room)
    else:
        chars = room * 6  # generous: cut to `room` tokens below
        start = rng.randrange(0, max(1, len(text) - chars))
        context = text[start : start + chars]
    ids = tokenizer(context, add_special_tokens=False)["input_ids"][:room]
    context = tokenizer.decode(ids)
    cut = int(len(context) * depth / 100)
    period = context.rfind(".", 0, cut)
    cut = period + 1 if period >= 0 else cut
    return Probe(context[:cut] + needle + context[cut:], question, value, needle, depth, name, kind)


def probes(tokenizer, probe_set: ProbeSet, data: Path | None, tokens: int, count: int, seed: int = 0):
    """`count` probes of `probe_set` of about `tokens` tokens, cycling through its fillers, depths spread from
    5 % to 95 %, seeds from `seed`."""
    found = fillers(probe_set, data)
    for number in range(count):
        depth = round(5 + 90 * number / max(1, count - 1))
        yield probe(tokenizer, probe_set, found[number % len(found)], tokens, depth, seed + number)
