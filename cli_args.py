"""What every command line shares: argument types that refuse a bad value before anything is loaded,
a parser whose usage errors are one line, and the one-line exit for bad input found later.

A bad value is a usage error: one line on stderr naming the flag, exit code 2, the same code as a
bad input file (a checkpoint or config that cannot be used), so a script can tell "you asked for
something wrong" (2) from "it broke" (1).
"""
import argparse
import math
import re
import sys

USAGE_ERROR = 2


def _shows_default(action) -> bool:
    default = action.default
    # Identity, not ==: a default of 0 is worth showing, a store_true's False is not.
    return (bool(action.option_strings) and default is not None and default is not False
            and default is not argparse.SUPPRESS and default != [])


def _default_text(action) -> str:
    default = action.default
    value = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return value.replace("%", "%%")  # argparse %-formats help strings


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows every option's default beside its help; a help text that already names its
    default is left as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not _shows_default(action) or "default" in text.lower():
            return text
        return f"{text} (default: {_default_text(action)})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text is what --help is for), and --help
    shows each option's default (DefaultsHelpFormatter), also where the option has no help text."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def _add_action(self, action):
        # argparse prints nothing for an option without help text, not even through the formatter.
        if action.help is None and _shows_default(action):
            action.help = f"default: {_default_text(action)}"
        return super()._add_action(action)

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


def _checked(kind, ok, requirement):
    """An argparse type: text -> kind, refused with 'must be <requirement>' unless ok(value)."""
    def parse(text):
        value = _number(text, kind)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
positive_float = _checked(float, lambda v: v > 0, "> 0")
non_negative_int = _checked(int, lambda v: v >= 0, "0 or more")
# 0 is greedy; a negative temperature would sample the least likely tokens.
temperature = _checked(float, lambda v: v >= 0, ">= 0 (0 = greedy)")
# Nucleus mass: at 0 nothing would be kept.
top_p = _checked(float, lambda v: 0 < v <= 1, "in (0, 1]")
_top_k_count = _checked(int, lambda v: v >= 1, ">= 1 or 'off'")


def top_k(text):
    """A positive count of tokens kept, or 'off' (None: no top-k cut)."""
    return None if str(text).lower() in ("off", "none") else _top_k_count(text)


def device(text):
    """'cpu', 'cuda' or 'cuda:N', refused unless this machine has that device (not a traceback later)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got '{text}'")
    if text.startswith("cuda"):
        import torch

        index = int(text.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device (use --device cpu)")
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text
