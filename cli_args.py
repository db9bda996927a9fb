"""What every command line shares: argument types that refuse a bad value before anything is loaded,
a parser whose usage errors are one line, and the one-line exit for bad input found later.

A bad value is a usage error: one line on stderr naming the flag, exit code 2, the same code as a
bad input file (a checkpoint or config that cannot be used), so a script can tell "you asked for
something wrong" (2) from "it broke" (1).
"""
import argparse
import math
import sys

USAGE_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text is what --help is for)."""

    def error(self, message):
        exit_with_error(f"{message} (see --help)", self.prog)


def exit_with_error(message, prog=None):
    """Print `[prog: ]error: <first line of message>` on stderr and exit with USAGE_ERROR."""
    text = str(message).strip()
    first = text.splitlines()[0] if text else "unknown error"
    print(f"{prog + ': ' if prog else ''}error: {first}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def _number(text, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got '{text}'")
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got '{text}'")
    return value


def positive_int(text) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value:g}")
    return value


def temperature(text) -> float:
    """0 is greedy; a negative temperature would sample the least likely tokens."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {value:g}")
    return value


def top_p(text) -> float:
    """Nucleus mass in (0, 1]: at 0 nothing is kept."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def top_k(text):
    """A positive count of tokens kept, or 'off' (None: no top-k cut)."""
    if str(text).lower() in ("off", "none"):
        return None
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'off', got {value}")
    return value
