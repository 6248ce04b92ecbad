"""The `envbuild` command's entry point, kept free of imports: a Ctrl-C at any moment, even
while the CLI is still being imported, ends with one line and exit 130, never a traceback."""

import signal
import sys


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # `kill` or a scheduler's SIGTERM: unwind, so cleanups run


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        from .cli import run  # noqa: PLC0415  (inside the try: importing the CLI takes a while)

        run()
    except KeyboardInterrupt:
        sys.stderr.write("envbuild: interrupted\n")
        sys.exit(130)
    except Exception as error:  # a signal while the CLI's classes were being made arrives wrapped
        from .errors import signal_in  # noqa: PLC0415

        caught = signal_in(error)
        if caught is None:
            raise
        if isinstance(caught, KeyboardInterrupt):
            sys.stderr.write("envbuild: interrupted\n")
            sys.exit(130)
        sys.exit(caught.code)
    finally:  # the work is done (or undone); a Ctrl-C while the interpreter exits changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
