"""The interactive loop of `h2o chat`: reading input, slash commands, Ctrl-C, the transcript on exit."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rich.markup import escape

from h2o_cli.cli.common import stderr
from h2o_cli.cli.panel import LivePanel, PanelView, render_panel
from h2o_cli.errors import H2OError, UsageError
from h2o_cli.models import h2o_home
from h2o_cli.private import claim_private, private_file, private_folder

HELP = """\
[bold]Commands[/]
  /help              this list
  /stats             cache and speed figures
  /budget N          keep N tokens per KV head (or a fraction of the context window); re-reads the chat
  /policy NAME       h2o, local, sink, tova, full or recall; re-reads the chat (recall with 64 spare
                     slots, the others with 16, unless --chunk was given)
  /reset             forget the conversation
  /save FILE         write the transcript (FILE.json or FILE.md), or save the whole cache to a
                     folder FILE (any other name) to --resume without reading the chat again;
                     /save alone saves to --save's (or --resume's) folder
  /panel on|off      show or hide the live cache panel; /panel layer N or /panel all picks the view;
                     /panel alone prints it once
  /exit              leave (Ctrl-D too)
Multi-line input: Esc then Enter for a new line, or start and end a block with \"\"\".
Ctrl-C stops the current answer; the transcript is saved on exit (and the cache, with --save)."""


def history_path(home: Path) -> Path:
    """The input history, beside the transcripts in the private `chats` folder. A history left at the old
    place (`$H2O_HOME/chat_history`, 0644) is moved in."""
    path = private_folder(home / "chats") / "history"
    old = home / "chat_history"
    if old.is_file() and not path.exists():
        os.replace(old, path)
    return path


class LineReader:
    """Plain lines from stdin (no terminal): what scripted sessions and tests use."""

    def read(self, prompt: str) -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")


class TerminalReader:
    """prompt-toolkit line editor with a persistent history; Esc+Enter inserts a new line."""

    def __init__(self, history_file: Path) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _newline(event) -> None:
            event.current_buffer.insert_text("\n")

        private_folder(history_file.parent)
        private_file(history_file)  # prompt-toolkit appends to it under the umask otherwise
        self.session = PromptSession(history=FileHistory(str(history_file)), key_bindings=bindings)

    def read(self, prompt: str) -> str:
        return self.session.prompt(prompt)


class ChatLoop:
    """Reads messages and commands until /exit or Ctrl-D; the transcript is written after every turn."""

    def __init__(
        self, session, show_panel: bool, model_name: str, reader=None, chunk_of=None, save=None
    ) -> None:
        self.session = session
        self.save_path = save  # the saved read written on exit and by a bare /save (None: none)
        self.lock = None  # the `SaveLock` held on it, released on exit
        self.chunk_of = (
            chunk_of  # (policy, model, budget) -> the chat chunk /policy takes (None: keep the chunk)
        )
        self.show_panel = show_panel
        self.view = PanelView()
        self.model_name = model_name
        home = h2o_home()
        terminal = sys.stdin.isatty()
        self.reader = reader or (TerminalReader(history_path(home)) if terminal else LineReader())
        # Named by the chat's start, made unique when first saved (`claim_private`): chats started in the
        # same second, in one process or two, never share a file.
        self.chats, self.transcript_name = home / "chats", time.strftime("chat-%Y%m%d-%H%M%S")
        self.transcript_path: Path | None = None
        self.running = True

    def run(self) -> None:
        stderr.print(
            f"[bold]h2o chat[/] · {escape(self.model_name)} · budget {self.session.settings.budget}"
            f" tokens/head · {self.session.settings.policy} · /help for commands, Ctrl-D to leave"
        )
        try:
            while self.running:
                try:
                    text = self._read_message()
                except KeyboardInterrupt:
                    continue
                except EOFError:
                    break
                if not text.strip():
                    continue
                try:
                    if text.lstrip().startswith("/"):
                        self.command(text.strip())
                    else:
                        self.answer(text)
                except H2OError as error:
                    stderr.print(f"[bold red]error:[/] {escape(str(error))}")
        finally:
            self._save_transcript(final=True)
            self._save_read(final=True)

    def _read_message(self) -> str:
        """One message: a line, or the lines of a \"\"\" block."""
        first = self.reader.read(">>> ")
        stripped = first.strip()
        if not stripped.startswith('"""'):
            return first
        body = stripped[3:]
        if len(body) >= 3 and body.endswith('"""'):
            return body[:-3]
        lines = [body] if body else []
        while True:
            line = self.reader.read("... ")
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)

    def answer(self, text: str) -> None:
        session = self.session
        with _stop_on_sigint(session):
            if self.show_panel:
                with LivePanel(session, stderr, self.view) as panel:
                    for piece in session.send(text):
                        panel.tick(piece)
                sys.stdout.write(session.turns[-1].content)
            else:
                for piece in session.send(text):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        last, report = session.last, session.cache.report()
        note = " [yellow](stopped)[/]" if last.stopped == "interrupted" else ""
        stderr.print(
            f"[dim]{last.generated_tokens} tokens · {last.tokens_per_s:.1f} tok/s · cache "
            f"{report.length}/{report.settings.budget} per head · "
            f"{report.tokens_seen:,} tokens so far[/]{note}"
        )
        self._save_transcript()

    def command(self, line: str) -> None:
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        handler = {
            "/help": self._help,
            "/stats": self._stats,
            "/budget": self._budget,
            "/policy": self._policy,
            "/reset": self._reset,
            "/save": self._save,
            "/panel": self._panel,
            "/exit": self._exit,
            "/quit": self._exit,
        }.get(name)
        if handler is None:
            raise UsageError(f"unknown command {name}; /help lists them")
        handler(argument)

    def _help(self, argument: str) -> None:
        stderr.print(HELP)

    def _stats(self, argument: str) -> None:
        figures = self.session.stats()
        for key, value in figures.items():
            shown = (
                f"{value:,.2f}"
                if isinstance(value, float)
                else (f"{value:,}" if isinstance(value, int) else value)
            )
            stderr.print(f"  {key:<26} {shown}")

    def _budget(self, argument: str) -> None:
        from h2o_cli.config import parse_budget
        from h2o_cli.runtime import context_window

        if not argument:
            raise UsageError("/budget needs a value, e.g. /budget 256 or /budget 0.05")
        tokens = parse_budget(argument, context_window(self.session.model))
        self._rebuild(f"/budget {argument}", self.session.set_budget, tokens)
        stderr.print(
            f"budget {tokens} tokens per KV head; {self.session.cache.report().tokens_seen:,} tokens re-read"
        )

    def _policy(self, argument: str) -> None:
        from h2o_cli.policies import policy_names

        if argument not in policy_names():
            raise UsageError(f"/policy needs one of {', '.join(policy_names())}")
        chunk = None
        if self.chunk_of is not None:  # the new policy's chat chunk, in the room beside the budget
            chunk = self.chunk_of(argument, self.session.model, self.session.settings.budget)
        self._rebuild(f"/policy {argument}", lambda name: self.session.set_policy(name, chunk), argument)
        stderr.print(
            f"policy {argument} ({self.session.settings.chunk} spare slots); "
            f"{self.session.cache.report().tokens_seen:,} tokens re-read"
        )

    def _rebuild(self, command: str, change, value) -> None:
        """Re-read the conversation into a new cache; on failure or Ctrl-C the chat goes on as it was."""
        settings = self.session.settings
        unchanged = f"the chat goes on unchanged ({settings.policy}, budget {settings.budget})"
        try:
            with stderr.status("re-reading the conversation …") if sys.stderr.isatty() else _nothing():
                change(value)
        except KeyboardInterrupt:
            raise H2OError(f"{command} interrupted; {unchanged}") from None
        except H2OError as error:
            raise type(error)(f"{command} failed: {error}; {unchanged}") from error

    def _reset(self, argument: str) -> None:
        self._save_transcript()
        self.session.reset()
        self.transcript_name, self.transcript_path = time.strftime("chat-%Y%m%d-%H%M%S-reset"), None
        stderr.print("conversation cleared")

    def _save(self, argument: str) -> None:
        if not argument and self.save_path is None:
            raise UsageError(
                "/save needs a name: /save chat.md or chat.json (transcript), /save NAME (cache)"
            )
        if argument and Path(argument).suffix.lower() in (".json", ".md"):
            path = self.session.save(argument)
            stderr.print(f"transcript saved to {escape(str(path))}")
            return
        if argument and Path(argument).expanduser().absolute() != Path(self.save_path or "").absolute():
            from h2o_cli.saved_checks import SaveLock

            lock = SaveLock(argument)  # another writer of that save refuses this one
            try:
                written = self.session.save_read(argument, self.model_name)
            finally:
                lock.release()
            stderr.print(
                f"chat saved to {escape(argument)} ({written:,} bytes): h2o chat --resume {escape(argument)}"
            )
            return
        self._save_read()

    def _save_read(self, final: bool = False) -> None:
        """Save the chat's cache to `save_path` (on exit: then release its lock)."""
        if self.save_path is None:
            return
        try:
            written = self.session.save_read(self.save_path, self.model_name)
            stderr.print(f"chat saved to {escape(str(self.save_path))} ({written:,} bytes)")
        finally:
            if final and self.lock is not None:
                self.lock.release()

    def _panel(self, argument: str) -> None:
        words = argument.split()
        if not words:
            from h2o_cli.chat import take_snapshot

            snapshot = take_snapshot(self.session.cache)
            turns = [(turn.role, turn.start) for turn in self.session.turns]
            stderr.print(
                render_panel(
                    snapshot,
                    self.view,
                    stderr.width,
                    10_000,
                    self.session.decode_token,
                    turns,
                    self.session.last.tokens_per_s,
                )
            )
        elif words == ["on"] or words == ["off"]:
            self.show_panel = words[0] == "on"
            if self.show_panel and not sys.stderr.isatty():
                stderr.print(
                    "[yellow]note:[/] stderr is not a terminal; the live panel stays off (/panel prints it)"
                )
                self.show_panel = False
        elif words == ["all"]:
            self.view = PanelView()
        elif words[0] == "layer" and len(words) == 2 and words[1].isdigit():
            layer = int(words[1])
            layers = self.session.cache.report().shape.n_layers
            if layer >= layers:
                raise UsageError(f"layer {layer} does not exist; the model has {layers}")
            self.view = PanelView(layer=layer)
        else:
            raise UsageError("/panel takes on, off, all or layer N")

    def _exit(self, argument: str) -> None:
        self.running = False

    def _save_transcript(self, final: bool = False) -> None:
        if not self.session.turns:
            return
        if self.transcript_path is None:
            self.transcript_path = claim_private(self.chats, self.transcript_name, ".json")
        path = self.session.save(self.transcript_path)
        if final:
            stderr.print(f"transcript saved to {escape(str(path))}")


@contextmanager
def _stop_on_sigint(session):
    """Ctrl-C during an answer sets a flag checked between tokens, so no forward pass is cut in half."""

    def stop(signum, frame) -> None:
        session.stop_requested = True

    try:
        previous = signal.signal(signal.SIGINT, stop)
    except ValueError:  # not the main thread: leave Ctrl-C as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _nothing():
    yield
