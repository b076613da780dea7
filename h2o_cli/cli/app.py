"""The `h2o` command: Typer wiring and the error boundary (one red line, exit 1; usage errors exit 2)."""

from __future__ import annotations

import os
import sys

import click
import typer

from h2o_cli import __version__
from h2o_cli.cli import chat, models_cmd, stream
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


def _version(value: bool) -> None:
    if value:
        print(f"h2o {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """h2o: H2O heavy-hitter KV-cache eviction for long contexts in constant memory."""


def _fail(message: str, code: int) -> None:
    from h2o_cli.cli.common import stderr

    stderr.print(f"[bold red]h2o: error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    sys.exit(code)


def main() -> None:
    """Entry point: run the app, turn library errors into one line, keep tracebacks for H2O_DEBUG=1."""
    debug = os.environ.get("H2O_DEBUG") == "1"
    command = typer.main.get_command(app)
    try:
        command.main(prog_name="h2o", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
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
