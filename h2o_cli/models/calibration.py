"""A model's lead head, found once per weights and kept: `$H2O_HOME/calibration/<fingerprint>.json`.

`--recall-lead auto` takes the head `h2o calibrate` found (`h2o_cli.eval.retrieval_heads` on the tuning probes
of `h2o_cli.eval.probes`). The file is keyed by `fingerprint`, a hash of the weights themselves, not of the
path or name the model was loaded by: a renamed copy finds its calibration, other weights under an old name
do not. Where no file exists, `auto` calibrates once, the first time a recall cache is built for the weights
(`ensure`), when the model's tokenizer can be found beside its weights; else it leads with no head.

Why a sampled fingerprint is enough: the key must tell apart weights whose retrieval heads may differ, and
any training or fine-tuning step, or another quantisation, moves nearly every element of every tensor; the
hash covers every tensor's name and shape and `SAMPLES` evenly spaced elements of each, rounded to bfloat16
(so the same weights loaded as float32 or bfloat16 share their calibration). An edit that spares every
sampled element keeps the key: the cost of that is a worse lead head, never a wrong answer's safety.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from h2o_cli.cache.build import register_lead_finder
from h2o_cli.private import h2o_home, write_private

VERSION = 2  # of the probes and the score: a file of another version is calibrated again
SAMPLES = 4096  # elements hashed per tensor
PROBE_TOKENS = 1024  # tokens per tuning probe
PROBE_COUNT = 12


def fingerprint(model) -> str:
    """A hex digest of `model`'s weights (names, shapes, and `SAMPLES` evenly spaced elements per tensor as
    bfloat16), the same for the same weights whatever their path, name, dtype or device. Kept on the model
    (`h2o_fingerprint`) after the first call."""
    known = getattr(model, "h2o_fingerprint", None)
    if known:
        return known
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        if tensor.is_meta or not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1)
        count = min(SAMPLES, flat.numel())
        picks = (torch.arange(count) * (flat.numel() - 1) // max(1, count - 1)).to(flat.device)
        digest.update(flat[picks].to(torch.bfloat16).cpu().view(torch.int16).numpy().tobytes())
    model.h2o_fingerprint = digest.hexdigest()[:32]
    return model.h2o_fingerprint


def cache_file(key: str) -> Path:
    """Where the calibration of the weights whose `fingerprint` is `key` is kept."""
    return h2o_home() / "calibration" / f"{key}.json"


def load(model) -> dict | None:
    """The kept calibration of `model`'s weights (a file of this `VERSION`), or None."""
    path = cache_file(fingerprint(model))
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("version") == VERSION else None


def lead_of(found: dict | None) -> tuple[int, int] | None:
    """The (layer, KV head) of a calibration, or None (none kept, or no probe answered)."""
    lead = (found or {}).get("lead")
    return (int(lead[0]), int(lead[1])) if lead else None


def run(
    model,
    tokenizer,
    data: Path | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
    count: int = PROBE_COUNT,
    tokens: int = PROBE_TOKENS,
    name: str | None = None,
) -> dict:
    """Calibrate `model` on `count` tuning probes of `tokens` tokens (fillers from the data folder `data`,
    or random word lists alone) and keep the result (0600) under its fingerprint. `progress(done, count,
    row)` after each probe. Returns what was kept: {"version", "fingerprint", "model", "lead", "ranked"
    (the ten best), "score", "others" (the other scores' five best), "runs", "answered", "copied",
    "seconds", "probes", "tokens"}."""
    from h2o_cli.eval.probes import TUNING, probes
    from h2o_cli.eval.retrieval_heads import calibrate

    tokens = min(tokens, getattr(model.config, "max_position_embeddings", tokens) - 64)
    started, done = time.perf_counter(), []

    def step(row: dict) -> None:
        done.append(row)
        if progress is not None:
            progress(len(done), count, row)

    report = calibrate(model, tokenizer, probes(tokenizer, TUNING, data, tokens, count), step)
    kept = {
        "version": VERSION,
        "fingerprint": fingerprint(model),
        "model": name or getattr(model, "h2o_name", None),
        "loaded_from": str(getattr(model.config, "_name_or_path", "") or ""),
        "lead": report["lead"],
        "ranked": report["ranked"][:10],
        "score": report["score"],
        "others": report["others"],
        "runs": report["runs"],
        "answered": sum(row["correct"] for row in report["runs"]),
        "copied": report["copied"],
        "probes": count,
        "tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_private(cache_file(kept["fingerprint"]), json.dumps(kept, indent=1) + "\n")
    return kept


def kept() -> list[dict]:
    """Every calibration kept in `$H2O_HOME/calibration` (of this `VERSION`)."""
    found = []
    for path in sorted((h2o_home() / "calibration").glob("*.json")):
        try:
            item = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(item, dict) and item.get("version") == VERSION:
            found.append(item)
    return found


def kept_for(names: set[str], found: list[dict] | None = None) -> dict | None:
    """The kept calibration (of `found`, default `kept()`) of a model loaded by one of `names` (aliases, hub
    ids, file or folder names; compared lower-case, by last path part, a converted GGUF folder by its file's
    stem): for `h2o models`, which cannot load every model to hash it. None where none matches."""
    wanted = {name.lower() for name in names if name}
    for item in kept() if found is None else found:
        for given in (item.get("model"), item.get("loaded_from")):
            base = str(given or "").rstrip("/").rsplit("/", 1)[-1].lower()
            if base and (base in wanted or any(base.startswith(name + "-") for name in wanted)):
                return item
    return None


def data_folder(root: str | Path | None = None) -> Path | None:
    """The data folder whose novels the tuning probes read: `root`, else `$H2O_DATA`; None where neither is
    a folder (the probes then read random word lists alone)."""
    from h2o_cli.eval.data import DATA_ENV

    folder = root or os.environ.get(DATA_ENV)
    return Path(folder) if folder and Path(folder).is_dir() else None


def own_tokenizer(model):
    """The tokenizer kept beside `model`'s weights (its `name_or_path` folder), or None."""
    folder = Path(str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")))
    if not folder.is_dir() or not any(
        (folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def text_progress(done: int, count: int, row: dict) -> None:
    """A one-line progress bar on stderr (rewritten in place on a terminal)."""
    bar = "#" * (20 * done // count)
    end = "\n" if done == count or not sys.stderr.isatty() else "\r"
    sys.stderr.write(f"calibrating the lead head [{bar:<20}] {done}/{count} probes{end}")
    sys.stderr.flush()


def ensure(
    model, progress: Callable[[int, int, dict], None] | None = text_progress
) -> tuple[int, int] | None:
    """`--recall-lead auto`'s head for `model`: its kept calibration's, else calibrated now (once per weights,
    `PROBE_COUNT` probes, with `progress`) when its tokenizer is found beside its weights, else None."""
    found = load(model)
    if found is None:
        tokenizer = own_tokenizer(model)
        if tokenizer is None:
            return None
        with calibration_lock():  # another process calibrating the same weights: wait, then take its file
            found = load(model)
            if found is None:
                if progress is text_progress:
                    sys.stderr.write(
                        "no calibration for these weights yet: finding the lead head once (h2o calibrate)\n"
                    )
                found = run(model, tokenizer, data_folder(), progress)
    return lead_of(found)


@contextlib.contextmanager
def calibration_lock():
    """An exclusive lock on `$H2O_HOME/calibration/.lock` (0600 in a 0700 folder) while held, so that two
    processes (test workers, two first runs) calibrate the same weights once."""
    import fcntl

    folder = h2o_home() / "calibration"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _registered_finder(model) -> tuple[int, int] | None:
    """`ensure`, looked up when called (so a patched `ensure` or `run` is the one used)."""
    return ensure(model)


register_lead_finder(_registered_finder)
