"""The `envbuild` command's entry point, kept free of imports: a Ctrl-C at any moment, even
while the CLI is still being imported, ends with one line and exit 130, never a traceback."""

import signal
import sys


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # `kill` or a scheduler's SIGTERM: unwind, so cleanups run


def _interrupted(signum, frame):
    """Ctrl-C, as Python's own handler, and remembered: a library that catches the exception and
    raises its own without a chain to it must not turn the Ctrl-C into an internal error."""
    errors = sys.modules.get("envbuild.base.errors")  # not imported yet: nothing can have wrapped it
    if errors is not None:
        errors.INTERRUPTS.append(signum)
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        from envbuild.cli import run  # noqa: PLC0415  (inside the try: importing the CLI takes a while)

        run()
    except KeyboardInterrupt:
        sys.stderr.write("envbuild: interrupted\n")
        sys.exit(130)
    except Exception as error:  # a signal while the CLI's classes were being made arrives wrapped
        from envbuild.base.errors import signal_in  # noqa: PLC0415

        caught = signal_in(error)
        if caught is None:
            raise
        if isinstance(caught, KeyboardInterrupt):
            sys.stderr.write("envbuild: interrupted\n")
            sys.exit(130)
        sys.exit(caught.code)
    finally:  # the work is done (or undone); a Ctrl-C while the interpreter exits changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
