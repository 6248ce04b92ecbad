"""The one exception type users see: a single paragraph, exit code 2, no traceback."""

import difflib


class EnvbuildError(Exception):
    """A problem with the user's input or environment, explained in one paragraph.

    Parameters
    ----------
    message:
        What was wrong, naming the input and the nearest valid choices.
    exit_code:
        Process exit code the CLI uses (2 for bad input, 1 for failed builds/checks).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def nearest(word: str, choices, n: int = 3) -> list[str]:
    """The closest valid spellings, for 'did you mean' hints."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(word.lower(), choices, n=n, cutoff=0.5)
    if not close:
        close = [c for c in choices if c.startswith(word.lower()[:2])][:n]
    return close


# The Ctrl-Cs the entry point's handler turned into KeyboardInterrupt this run (console.py): a
# wrapper that keeps no chain to it (pydantic-core's SchemaError, when the signal lands while a
# model's validator is being built) still ends the run as interrupted, not as a bug.
INTERRUPTS: list[int] = []


def signal_in(error: BaseException):
    """The SystemExit (a SIGTERM's unwinding) or KeyboardInterrupt (a Ctrl-C) inside `error`'s
    chain, or None: a signal that lands while a class is being made surfaces wrapped (Python
    3.11: RuntimeError "Error calling __set_name__", from the signal's exception) and is a
    signal still, not a bug of envbuild's. After a Ctrl-C (INTERRUPTS) any error is its
    consequence."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (SystemExit, KeyboardInterrupt)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return KeyboardInterrupt() if INTERRUPTS else None
