"""The `h2o` command: Typer wiring and the error boundary (one red line, exit 1; usage errors exit 2)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import typer

from h2o_cli import __version__
from h2o_cli.cli import (
    bench,
    calibrate,
    chat,
    compare,
    lm_eval_cmd,
    memory,
    models_cmd,
    passkey,
    plot,
    stream,
)
from h2o_cli.cli import eval as eval_cmd
from h2o_cli.errors import H2OError

app = typer.Typer(
    name="h2o",
    help="Chat with and stream through very long contexts on a fixed memory budget (H2O KV-cache eviction).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
app.command("stream", no_args_is_help=True)(stream.stream)
app.command("chat")(chat.chat)
app.command("models")(models_cmd.models)
app.command("memory")(memory.memory)
app.command("eval", no_args_is_help=True)(eval_cmd.eval)
app.command("passkey", no_args_is_help=True)(passkey.passkey)
app.command("calibrate")(calibrate.calibrate)
app.command("compare", no_args_is_help=True)(compare.compare)
app.command("plot", no_args_is_help=True)(plot.plot)
app.command("bench")(bench.bench)
app.command(
    "lm-eval",
    no_args_is_help=True,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(lm_eval_cmd.lm_eval)


def _version(value: bool) -> None:
    if value:
        print(f"h2o {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """h2o: H2O heavy-hitter KV-cache eviction for long contexts in constant memory."""


def _fail(message: str, code: int) -> None:
    from rich.markup import escape

    from h2o_cli.cli.common import stderr

    # The message is text, not markup: "pip install 'h2o-cli[gemma]'" keeps its "[gemma]".
    stderr.print(f"[bold red]h2o: error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    sys.exit(code)


class Terminated(SystemExit):
    """SIGTERM (`kill`, `timeout`) or SIGHUP (the terminal closed): the process ends as after an error, its
    `finally` blocks and exit hooks run (a recall archive's file is removed), with exit code 128 + the signal's
    number."""


def _terminate(number: int, frame) -> None:
    raise Terminated(128 + number)


def main() -> None:
    """Entry point: run the app, turn library errors into one line, keep tracebacks for H2O_DEBUG=1."""
    debug = os.environ.get("H2O_DEBUG") == "1"
    command = typer.main.get_command(app)
    with contextlib.suppress(ValueError):  # not the main thread (an embedding app): leave its handler alone
        signal.signal(signal.SIGTERM, _terminate)
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # not under nohup, which asks to keep running
            signal.signal(signal.SIGHUP, _terminate)
    try:
        try:
            command.main(prog_name="h2o", standalone_mode=False)
        except SystemExit as done:
            # typer turns EPIPE into exit 1 after wrapping the streams; for us a closed reader is no error.
            if type(sys.stdout).__name__ == "PacifyFlushWrapper" and not isinstance(done, Terminated):
                raise BrokenPipeError from done
            raise
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as error:  # typer's own (vendored) click usage errors: usage line + message
        error.show()
        sys.exit(getattr(error, "exit_code", 2))
    except H2OError as error:
        if debug:
            raise
        _fail(str(error), error.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except MemoryError:
        _fail("out of memory; lower --budget or --chunk, or use a smaller model", 1)
    sys.exit(0)
