"""What the package's two commands, ``wide-moe`` and ``wide-moe-tune``, share: their name
as invoked, and one error policy.

A bad invocation prints one line, ``<command>: error: <what>`` naming the argument or the
file, and exits 2 (a bad argument) or 1 (bad data: a broken checkpoint, a config the
layer cannot serve, a failure while running); never a traceback, unless ``--debug``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def invoked_name(module: str) -> str:
    """The command's name as the user typed it: the installed script's (``wide-moe``), or
    ``python -m module`` when run as a module (``sys.argv[0]`` is then the file's path)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return f"python -m {module}" if name in ("", "-c") or name.endswith(".py") else name


class UsageError(Exception):
    """A bad argument: the command exits 2 with this message (which names the argument)."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors raise ``UsageError`` instead of printing the usage
    and exiting, so that the command reports them as one line (``run``). Every command
    built on it takes ``--debug``."""

    def __init__(self, module: str, **kwargs):
        super().__init__(prog=invoked_name(module),
                         formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.add_argument("--debug", action="store_true",
                          help="on an error, show Python's traceback instead of one line "
                               "(default: off)")

    def error(self, message):
        raise UsageError(message)


def run(command: str, parser: Parser, body, argv=None) -> int:
    """Parse ``argv`` with ``parser``, then ``body(args, parser)``'s exit status. An error
    prints one line on stderr, ``<command>: error: ...``, and gives 2 for a bad argument
    (``UsageError``), 1 for anything else; with ``--debug`` the exception propagates
    instead (a bad argument still prints its line: it has no traceback worth showing)."""
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        return _report(command, str(err), 2)
    try:
        return body(args, parser)
    except UsageError as err:
        return _report(command, str(err), 2)
    except KeyboardInterrupt:
        if args.debug:
            raise
        return _report(command, "interrupted", 130)
    except Exception as err:  # noqa: BLE001  (the policy: one line, the type where it helps)
        if args.debug:
            raise
        return _report(command, _one_line(err), 1)


# Errors whose message is meant for the user as it is: the package raises them naming
# the argument, field, tensor or file (an OSError's message names its file).
_PLAIN = (ValueError, TypeError, OSError)


def _one_line(err: BaseException) -> str:
    """``err``'s message on one line: its first line, after the exception's type where it
    is not one the package raises for the user, and a pointer to ``--debug`` where lines
    were left out."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if not isinstance(err, _PLAIN) or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    if len(lines) > 1:
        text += " (--debug shows the rest)"
    return text


def _report(command: str, message: str, status: int) -> int:
    print(f"{command}: error: {message}", file=sys.stderr, flush=True)
    return status


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def natural_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
