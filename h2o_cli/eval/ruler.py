"""lm-eval's RULER tasks (`--tasks niah_single_1`, ...) offline.

The tasks generate their documents for the model's own tokenizer (lm-eval's `ruler/` folder), and reach the
network twice:
- importing `prepare_niah` downloads nltk's `punkt_tab` sentence model when it is not installed; the essay
  tasks split their haystack into sentences with it, to place the needles at sentence starts. Without it
  (offline, nothing to download) the sentences are split by nltk's Punkt with no trained parameters (the same
  algorithm without its list of abbreviations), and one line says so.
- the essay tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery) read Paul Graham essays
  from the Hub dataset `baber/paul_graham_essays`. When it cannot be read they read the essays of the data
  folder (`$H2O_DATA/paul_graham_essays/PaulGrahamEssays`, the needle-in-a-haystack test's 49, ~640K
  characters) instead, and one line says so; with neither, the task stops with one line saying why.

`prepare_offline` swaps both in lm-eval's `prepare_niah` module; it must run before lm-eval reads its task
files (`h2o lm-eval` calls it when a RULER task is asked for).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from pathlib import Path

ESSAYS = Path("paul_graham_essays") / "PaulGrahamEssays"  # under the data folder


def ruler_names() -> set[str]:
    """lm-eval's RULER task, group and tag names: what its `ruler/*.yaml` files declare (`task: ruler_vt`,
    `group: ruler`, `tag:` with `- longcxt` under it), which is not always the file's name (`vt.yaml`)."""
    import lm_eval.tasks

    names: set[str] = set()
    for path in (Path(lm_eval.tasks.__file__).parent / "ruler").glob("*.yaml"):
        text = path.read_text()
        # `tag:` holds one name on its line, or a list of `- name` lines below it
        names |= set(re.findall(r"^(?:task|group|tag):[ \t]*([\w-]+)", text, re.M))
        for items in re.findall(r"^tag:[ \t]*\n((?:[ \t]+-[^\n]*\n?)+)", text, re.M):
            names |= set(re.findall(r"-[ \t]*([\w-]+)", items))
    return names


def asked_tasks(args: Sequence[str]) -> list[str]:
    """The task names of lm-eval arguments (`--tasks a,b` or `--tasks=a,b`)."""
    names: list[str] = []
    for number, arg in enumerate(args):
        if arg == "--tasks" and number + 1 < len(args):
            names += args[number + 1].split(",")
        elif arg.startswith("--tasks="):
            names += arg.split("=", 1)[1].split(",")
    return [name.strip() for name in names if name.strip()]


def prepare_offline(say: Callable[[str], None] = print) -> None:
    """Make lm-eval's RULER generator run without the network: the sentence split and the essays (above).
    `say` prints each one-line note."""
    import nltk
    from lm_eval.tasks.ruler import prepare_niah  # tries to download punkt_tab when it is missing

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        prepare_niah.cached_sent_tokenize = lru_cache(maxsize=1024)(PunktSentenceTokenizer().tokenize)
        say(
            "RULER: nltk's punkt_tab is not installed (`python -m nltk.downloader punkt_tab`); essay sentences "
            "are split by Punkt without its trained abbreviations"
        )
    hub_haystack = getattr(prepare_niah.get_haystack, "hub_haystack", prepare_niah.get_haystack)

    @cache
    def get_haystack(type_haystack):
        if type_haystack != "essay":
            return hub_haystack(type_haystack)
        try:
            return hub_haystack(type_haystack)
        except OSError as error:  # offline: datasets' ConnectionError, or nothing cached
            words = essay_words(error)
            say(
                f"RULER: the Hub's Paul Graham essays are out of reach; the data folder's are read instead ({error})"
            )
            return words

    get_haystack.hub_haystack = hub_haystack  # called again: wrap lm-eval's own, not this one
    prepare_niah.get_haystack = get_haystack  # the task modules import it by name when lm-eval reads them


def essay_words(cause: Exception) -> list[str]:
    """The data folder's essays as lm-eval's `get_haystack("essay")` makes the Hub's: whitespace-split words."""
    from h2o_cli.errors import H2OError
    from h2o_cli.eval.data import data_dir, load_essays

    try:
        text = load_essays(data_dir() / ESSAYS)
    except H2OError as error:
        raise H2OError(
            f"RULER's essay tasks need the Hub's Paul Graham essays ({cause}) or {error}"
        ) from cause
    return re.sub(r"\s+", " ", text).split(" ")
