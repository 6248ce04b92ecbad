"""The command group, its console and the display helpers every command shares; `run` turns a
user's mistake into one paragraph and exit 2, never a traceback."""

from __future__ import annotations

import errno
import io
import os
import shlex
import sys
import tempfile

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from envbuild import __version__
from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, signal_in
from envbuild.base.grammar import redact

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="envbuild")
def main():
    """Reproducible GPU training images: pinned torch/CUDA/DeepSpeed stacks with pre-built
    DeepSpeed ops, per-GPU NCCL defaults and a built-in smoke test."""


class OnceOption(click.Option):
    """An option that takes one value refuses to be given twice: click keeps the last
    silently, so `--gpu h100 --gpu h20` would render h20 without a word."""

    def add_to_parser(self, parser, ctx) -> None:
        self.multiple = True  # collect every occurrence; consume_value checks there is one
        try:
            super().add_to_parser(parser, ctx)
        finally:
            self.multiple = False

    def consume_value(self, ctx, opts):
        given = opts.get(self.name)
        if isinstance(given, list):
            if len(given) > 1:
                flag = max(self.opts, key=len)
                raise EnvbuildError(f"{flag} is given {len(given)} times ({', '.join(map(str, given))}); give it "
                                    f"once: a second value would silently replace the first. Run one command per "
                                    f"value.")
            opts = {**opts, self.name: given[0]}
        return super().consume_value(ctx, opts)


def refuse_repeated_options(group: click.Group) -> None:
    """Make every single-value option of every command a :class:`OnceOption`."""
    for command in [group, *group.commands.values()]:
        if isinstance(command, click.Group) and command is not group:
            refuse_repeated_options(command)
        for p in command.params:
            if type(p) is click.Option and not (p.multiple or p.is_flag or p.count):
                p.__class__ = OnceOption


def table(title, headers, rows, ids=(), **table_options) -> Table:
    """A rich table; the columns in `ids` hold names to copy (stack ids, GPU names, tags) and
    are never wrapped or folded, whatever the terminal width."""
    t = Table(title=title, title_justify="left", show_lines=False, **table_options)
    for i, h in enumerate(headers):
        if i in ids:
            t.add_column(h, no_wrap=True, min_width=max([len(str(r[i])) for r in rows] + [len(h)]))
        else:  # wraps between words; never narrower than its longest word (up to 20 characters)
            words = [len(w) for r in rows for w in str(r[i]).split()] + [len(w) for w in h.split()]
            t.add_column(h, overflow="fold", min_width=min(max(words, default=1), 20))
    for r in rows:
        t.add_row(*[escape(str(c)) for c in r])
    return t


def print_table(t: Table) -> None:
    """A table at least as wide as its columns' minimum, even where the terminal (or a pipe's
    default 80 columns) is narrower: the terminal wraps a line rather than rich cutting
    every column down to two characters."""
    from rich.measure import Measurement

    need = Measurement.get(out, out.options, t).minimum
    out.print(t, width=max(out.width, need))


def command_line(ctx: click.Context, skip=()) -> str:
    """The command as typed (the options given on the command line), for the `next:` block."""
    from click.core import ParameterSource

    words = ["envbuild", ctx.command.name]
    for p in ctx.command.params:
        if p.name in skip or ctx.get_parameter_source(p.name) is not ParameterSource.COMMANDLINE:
            continue
        flag, value = max(p.opts, key=len), ctx.params[p.name]
        if isinstance(value, str):  # never print a URL's password (a mirror's, a service's)
            value = redact(value)
        if getattr(p, "is_flag", False):
            words += [flag] if value else []
        elif p.multiple:
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def print_next(lines):
    """The `next:` block: commands on lines of their own, never wrapped (copy and paste)."""
    out.print("next (docs/running.md: Slurm, multi-node, per-job caches):", markup=False)
    for line in lines:
        out.print(f"  {line}", markup=False, soft_wrap=True)


def notes(title, notes):
    """`key  text` lines under a table; the text wraps with a hanging indent, the key never."""
    if not notes:
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for key, text in notes:
        grid.add_row(escape(key), escape(text))
    out.print(f"\n{title}")
    out.print(grid)


def blocks(title, blocks):
    """One block per default: its VAR=VALUE on a line of its own, then labelled, wrapped text."""
    out.print(f"\n[bold]{escape(title)}[/bold]", soft_wrap=False)
    for head, where, fields in blocks:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        for label, text in [("gpus" if "not" in fields[0][0] else "gpu", where), *fields]:
            grid.add_row(f"  {label}", escape(text))
        out.print(f"\n[bold]{escape(head)}[/bold]", soft_wrap=True)
        out.print(grid)


def markers_note(texts):
    """Explain [V]/[S]/[U] and "field report N" when any shown text holds one."""
    from envbuild.render.tables import MARKERS

    if any(w in t for t in texts for w in ("[V", "[S", "[U", "field report")):
        out.print(f"\n{MARKERS}", markup=False, soft_wrap=False)


def _stdout_closed() -> bool:
    """Whether standard output was closed when envbuild started (``>&-``): Python then sets
    sys.stdout to None and every print vanishes, so a command would succeed with its results
    thrown away."""
    if sys.stdout is None:
        return True
    try:
        os.fstat(sys.stdout.fileno())
    except (io.UnsupportedOperation, AttributeError):  # an in-memory stream (a test's capture): not closed
        return False
    except (OSError, ValueError):  # EBADF; a stream closed in this process
        return True
    return False


def _flush_stdout() -> None:
    """What a command printed reaches its reader, or the run fails saying so: a full disk or a
    closed pipe met at exit would otherwise be exit 0 (or Python's own exit 120)."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:  # `envbuild ... | head`: the reader has what it wanted
        _discard_stdout()
        sys.exit(141)


def _discard_stdout() -> None:
    """What is still buffered for standard output goes nowhere: Python flushes it once more at
    exit, and a full disk or a closed pipe there would make the exit code 120."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):  # no stdout to speak of
        pass


def run():
    """Console entry point: one-paragraph errors, never a traceback for bad input."""
    try:
        if _stdout_closed():
            raise EnvbuildError("standard output is closed (started with >&-?): envbuild prints its results and the "
                                "next commands there, and they would be lost; run it again with standard output "
                                "open, or redirected to a file or /dev/null.")
        main.main(standalone_mode=False)
        _flush_stdout()
    except EnvbuildError as e:
        # Whatever a message quotes (a value, a tool's output), no control character but a line
        # break or a tab reaches the terminal; the places that quote a value escape those too;
        # no URL's credentials (a mirror's, a service's) reach it at all.
        err.print(f"envbuild: error: {grammar.escaped(redact(e.message), keep=chr(10) + chr(9))}", markup=False)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:  # click's name for a Ctrl-C inside a command
        err.print("envbuild: interrupted", markup=False)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("envbuild: interrupted", markup=False)
        sys.exit(130)
    except Exception as e:  # a bug: say so plainly; ENVBUILD_DEBUG=1 shows the traceback
        if os.environ.get("ENVBUILD_DEBUG"):
            raise
        caught = signal_in(e)
        if isinstance(caught, KeyboardInterrupt):
            err.print("envbuild: interrupted", markup=False)
            sys.exit(130)
        if caught is not None:  # SIGTERM's SystemExit(143), wrapped on its way out
            sys.exit(caught.code)
        if isinstance(e, OSError) and e.filename:  # a path the user gave or the machine's state (full disk, ...)
            err.print(f"envbuild: error: {grammar.escaped(str(e.filename))}: {e.strerror or e}; check the path, its permissions and the "
                      f"free space, then run the command again (set ENVBUILD_DEBUG=1 for a traceback).",
                      markup=False)
            sys.exit(2)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # a write on an open file or pipe
            err.print(f"envbuild: error: {e.strerror or e} while writing: free space (or quota) where envbuild "
                      f"writes (the output directory, {tempfile.gettempdir()}, Docker's data root: `docker "
                      f"system df`), then run the command again; what this run left is cleaned by the next.",
                      markup=False)
            _discard_stdout()
            sys.exit(2)
        err.print(f"envbuild: internal error: {type(e).__name__}: {redact(str(e))} (set ENVBUILD_DEBUG=1 for a traceback)",
                  markup=False)
        sys.exit(70)
