"""The error contract every ``vllm-compat`` command follows.

- A user's mistake (a missing or unreadable file, a wrong format, an unknown model or
  tokenizer, bad layer ids, contradictory flags, empty input, no GPU where one is needed):
  one or two lines on stderr, what is wrong with which input and what to do; exit 2.
- An internal failure: one line naming it, one line saying how to see the traceback
  (``--debug`` or ``VLLM_COMPAT_DEBUG=1``); exit 1.
- Ctrl-C: one line saying what was finished and the command that resumes; exit 130.
- A reader that closes the pipe early (``| head``): no message, exit 141, as a shell reports it.

Arguments are checked at parse time where they can be (:mod:`vllm_compat.cli_args`), and
output directories are written as ``<output>.partial`` and renamed when the step completes
(:mod:`vllm_compat.cli_output`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .errors import VllmCompatError

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_USAGE", "ContractParser", "UsageError",
           "debug_requested", "is_user_error", "print_commands", "run_command"]

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader (`| head`) left; the shell's own code for it
DEBUG_ENV = "VLLM_COMPAT_DEBUG"


class UsageError(Exception):
    """A user's mistake: ``message`` says what is wrong with which input, ``hint`` what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class ContractParser(argparse.ArgumentParser):
    """argparse with the contract's two-line errors (argparse prints the whole usage, which
    for ``eagle3 extract`` is a screen); subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"  `{self.prog} --help` lists the arguments", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def debug_requested(argv: Sequence[str] = ()) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


# Errors the library raises on purpose that are about the run, not the user's input.
_RUNTIME_ERRORS = ("IsolatedCallError", "EvaluationError")


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a mistake in what the user gave: the library raises
    :class:`~vllm_compat.errors.VllmCompatError` and ``ValueError`` for bad input, and the
    OS the path errors below."""
    if isinstance(exc, UsageError):
        return True
    if isinstance(exc, VllmCompatError):
        return not any(c.__name__ in _RUNTIME_ERRORS for c in type(exc).__mro__)
    return isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                            PermissionError, ModuleNotFoundError))


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name:  # a package this command needs
        top = exc.name.split(".")[0]
        return (f"this command needs the {top} package, which is not installed (pip install "
                f"{top}; vllm-compat's extras eagle3, serve, ray bring theirs)")
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text += f": {exc.filename}"
    return text


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace, *,
                prog: str, argv: Sequence[str],
                on_interrupt: Callable[[], str] | None = None) -> int:
    """``func(args)`` under the contract. ``on_interrupt`` says what was finished when Ctrl-C
    arrives (the resume command is this one, as typed)."""
    debug = debug_requested(argv)
    try:
        code = int(func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader chose to stop reading: no message; stdout goes nowhere from now on, so
        # the interpreter's own flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        if debug:
            raise
        done = on_interrupt() if on_interrupt else "nothing was written"
        resume = shlex.join([prog.split()[0], *argv])
        print(f"\n{prog}: interrupted; {done}; resume with: {resume}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:  # the one place every command's failure ends up
        if debug:
            raise
        if is_user_error(exc):
            print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
            hint = getattr(exc, "hint", "")
            if hint:
                print(f"  {hint}", file=sys.stderr)
            return EXIT_USAGE
        print(f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        print(f"  rerun with --debug (or {DEBUG_ENV}=1) to see the traceback", file=sys.stderr)
        return EXIT_INTERNAL


def print_commands(parser: argparse.ArgumentParser) -> int:
    """What ``vllm-compat`` (or ``vllm-compat eagle3``) alone prints: the commands it takes."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows = [(c.dest, c.help or "") for c in sub._choices_actions]
    width = max(len(name) for name, _ in rows)
    lines = [f"usage: {parser.prog} <command> [arguments]  (`{parser.prog} <command> --help`)",
             "commands:"] + [f"  {name:<{width}}  {text}" for name, text in rows]
    print("\n".join(lines), file=sys.stderr)
    return EXIT_USAGE
