"""`h2o chat`: talk to a model on a fixed cache budget; one answer when stdin is piped."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import load
from h2o_cli.config import CacheSettings
from h2o_cli.errors import InputError
from h2o_cli.policy_registry import policy_class

# Spare cache slots beside the budget: a chat reads a turn in 256-token forward calls and the cache attends
# them 16 at a time, so at budget 32 it holds 48 slots per head, not 288.
CHAT_CHUNK = 16
# With `recall` a turn's question (its last paragraph, up to this many tokens with the template) is read
# whole, so its queries choose what comes back (docs/spec.md, recall: which queries choose; lead head), and
# every layer chooses pages once per this many tokens of text: 256 read a 20K-token chat in about half the
# time of 64, answered as well (docs/results.md); its spare slots are small beside the archive.
CHAT_RECALL_CHUNK = 256

ChatChunk = Annotated[
    int,
    typer.Option(
        "--chunk",
        min=1,
        help=f"Tokens the cache attends at a time: its spare slots beside the budget. Default {CHAT_CHUNK}, or "
        f"{CHAT_RECALL_CHUNK} with --policy recall, so that a message's question (its last paragraph) is read "
        "whole and chooses what recall brings back (less where budget + chunk would pass the context "
        "window). budget + chunk must fit in the context window.",
        show_default=False,
        rich_help_panel=opt.CACHE,
    ),
]

EXAMPLES = """
Examples:

  h2o chat
  h2o chat --model llama-7b --budget 0.1
  echo "Summarise: $(cat notes.txt)" | h2o chat
  h2o chat --system "You are terse." --max-new-tokens 200 --temperature 0.7 --seed 1
  h2o chat --quant 8bit --kv-bits 8 --budget 256
  h2o chat --resume notes-chat.json --policy recall
  h2o chat --policy recall --save notes.chat      # saved on exit (and by /save): resume in seconds
  h2o chat --resume notes.chat
"""


@opt.cache_options(
    options={"chunk": ChatChunk}, budget=opt.DEFAULTS["budget"], chunk=CHAT_CHUNK, lead_text=False
)
def chat(
    context: typer.Context,
    settings: CacheSettings,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System message.")] = None,
    model: opt.Model = opt.DEFAULTS["model"],
    max_new_tokens: opt.MaxNewTokens = 512,
    temperature: opt.Temperature = 0.0,
    top_p: opt.TopP = 1.0,
    seed: opt.Seed = None,
    no_panel: Annotated[
        bool, typer.Option("--no-panel", help="Hide the live cache panel.", rich_help_panel=opt.OUTPUT)
    ] = False,
    interactive: Annotated[
        bool,
        typer.Option("--interactive", "-i", help="Keep the chat loop even when stdin is not a terminal."),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One-shot mode: print one JSON object (answer and figures) on stdout.",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = False,
    quant: opt.Quant = "none",
    device: opt.Device = "auto",
    device_map: opt.DeviceMap = None,
    dtype: opt.Dtype = "auto",
    threads: opt.Threads = 0,
    trust_remote_code: opt.TrustRemoteCode = False,
    compiled: opt.Compile = False,
    keep_frame: Annotated[
        bool,
        typer.Option(
            "--keep-frame/--no-keep-frame",
            help="Pin the chat template's tokens (the system message, role markers, turn ends) so that no "
            "policy evicts them: they take at most 1/8 of the budget, the system message and the newest "
            "turns' markers first (docs/chat.md: does the chat template survive eviction?).",
            rich_help_panel=opt.CACHE,
        ),
    ] = False,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Go on with a conversation: a saved read (a folder written by --save or /save NAME) is "
            "loaded as it was, without reading it again, and saved there again on exit; a transcript "
            "saved as JSON (/save FILE.json, or the one written on exit) is read into the cache first, the "
            "answers as saved, its system message kept unless --system replaces it.",
            show_default=False,
        ),
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save",
            help="Save the conversation's whole cache state to this folder on exit (and at /save): "
            "--resume it later without reading the conversation again. One chat at a time writes a save.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Chat with a model whose KV cache stays within --budget tokens per head, however long the talk.

    On a terminal: a chat loop (/help) with a live cache panel on stderr. Piped: one answer on stdout.
    """
    from h2o_cli.chat import ChatSession, read_transcript
    from h2o_cli.generation import Sampling
    from h2o_cli.models import context_window
    from h2o_cli.saved import is_saved_read, open_saved
    from h2o_cli.saved_checks import SaveLock, resume_settings

    started = time.perf_counter()
    sampling = Sampling(max_new_tokens, temperature, top_p, seed)
    one_shot = not interactive and not sys.stdin.isatty()
    message = _read_stdin() if one_shot else None
    read = open_saved(resume) if resume is not None and is_saved_read(resume) else None
    saved = read_transcript(resume) if resume is not None and read is None else (None, [])
    if read is not None:
        saved = _saved_chat(read, system)
        if left_default(context, "model"):
            model = read.manifest["model"]["name"]
    if system is None:
        system = saved[0]
    save = save or (resume if read is not None else None)  # a resumed save is saved again
    if read is not None:  # refused before the model loads, as a second writer is
        settings = resume_settings(read, given_settings(context, settings))
    lock = SaveLock(save) if save is not None else None
    lm, tokenizer = load(model, device, dtype, trust_remote_code, threads, quant, device_map)
    chunk_given = not left_default(context, "chunk")
    if read is None:
        settings = settings.resolved(context_window(lm))
        if not chunk_given:
            settings = replace(settings, chunk=default_chunk(settings.policy, lm, settings.budget))
    session = ChatSession(lm, tokenizer, settings, sampling, system, compiled=compiled, keep_frame=keep_frame)
    if read is not None:
        session.load_read(read, model)
        _said(
            f"resumed {len(session.turns)} messages ({session.cache.tokens_seen:,} tokens) of {read.path} "
            f"in {time.perf_counter() - started:.1f} s, without reading them again"
        )
    elif saved[1]:
        _resume(session, saved[1], resume)
    if one_shot:
        try:
            _answer_once(session, message, as_json, model)
        except BrokenPipeError:
            # The reader went away (`| head -1`): stop quietly. (click would turn EPIPE into exit code 1.)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        finally:
            if save is not None:
                try:
                    _said(f"saved the chat to {save}: {session.save_read(save, model):,} bytes")
                finally:
                    lock.release()
        return
    from h2o_cli.cli.chat_repl import ChatLoop

    show_panel = not no_panel and sys.stderr.isatty() and sys.stdin.isatty()
    loop = ChatLoop(session, show_panel, model, chunk_of=None if chunk_given else default_chunk, save=save)
    loop.lock = lock
    loop.run()


def _saved_chat(read, system: str | None) -> tuple[str | None, list]:
    """(system message, no turns to re-read) of a saved chat; a text's save or another --system is refused."""
    from h2o_cli.chat.session import CHAT

    if read.extra.get("kind") != CHAT:
        raise InputError(f"{read.path} is a read text, not a chat; ask it with h2o stream --resume")
    if system is not None and system != read.extra.get("system"):
        raise InputError(f"{read.path} was saved with another --system; resume it without --system")
    return read.extra.get("system"), []


def given_settings(context: typer.Context, settings: CacheSettings) -> dict:
    """The cache settings set on the command line, by field."""
    import dataclasses

    fields = dataclasses.fields(settings)
    return {
        field.name: getattr(settings, field.name) for field in fields if not left_default(context, field.name)
    }


def _said(text: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(text, highlight=False)


def default_chunk(policy: str, model=None, budget: int = 0) -> int:
    """`h2o chat`'s `--chunk` when none is given: `CHAT_RECALL_CHUNK` for a policy that recalls, else
    `CHAT_CHUNK`; with a `model`, cut to the room beside a `budget` of tokens in its context window (at
    least 1)."""
    from h2o_cli.runtime import context_window

    chunk = CHAT_RECALL_CHUNK if policy_class(policy).recalls else CHAT_CHUNK
    return chunk if model is None else min(chunk, max(context_window(model) - budget, 1))


def left_default(context: typer.Context, option: str) -> bool:
    """Whether the command line left `option` at its default (not given, nor set from the environment)."""
    source = context.get_parameter_source(option)
    return source is None or source.name in ("DEFAULT", "DEFAULT_MAP")


def _read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(
            f"stdin is not UTF-8 text (byte {error.start}); convert it first, e.g. with iconv"
        ) from None
    if not text.strip():
        raise InputError('stdin is empty; pipe a message, e.g. echo "Hello" | h2o chat')
    return text.strip()


def _resume(session, turns: list[dict], path: Path) -> None:
    """Read the saved turns into the session; say on stderr what was read and what was left out."""
    from rich.console import Console

    stderr = Console(stderr=True)
    with stderr.status(f"reading {len(turns)} messages of {path}", spinner="dots"):
        read = session.resume(turns)
    left = "; its last message had no answer and is left out: send it again" if read < len(turns) else ""
    stderr.print(
        f"resumed {read} messages ({session.cache.tokens_seen:,} tokens) of {path}{left}", highlight=False
    )


def _answer_once(session, message: str, as_json: bool, model: str) -> None:
    """Print the answer only (streamed), or with --json one object with the answer and the run's figures."""
    if as_json:
        answer = session.ask(message)
        print(json.dumps({"answer": answer, "model": model, **session.stats()}))
        return
    for piece in session.send(message):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


chat.__doc__ = (chat.__doc__ or "") + EXAMPLES
