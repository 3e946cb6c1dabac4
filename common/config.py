"""The small argument parser: a dataclass is the config, its fields are the command line.

    @dataclass
    class Config:
        group_size: int = 8  # completions per prompt
    cfg = parse(Config)            # python grpo.py --group-size 16

The comment after each field (else the comment lines right above it) is its --help text, followed by its
default; the module docstring's first paragraph is the description. Booleans take --flag / --no-flag. A
`choices` dict on the dataclass restricts string fields. Errors are one line and exit 2; see `main_guard`.
"""
import argparse
import dataclasses
import inspect
import math
import re
import sys

from common.errors import ConfigError, DataError, ModelError, RunError


def _field_comments(cls) -> dict:
    """Each field's help: the comment after it, else the comment lines right above it."""
    helps, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        comment = re.match(r"\s+#\s*(.*)$", line)
        field = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s*(.*))?$", line)
        if comment:
            above.append(comment[1])
            continue
        if field:
            helps[field[1]] = field[2] or " ".join(above)
        above = []
    return helps


def _description(module) -> str:
    """The module docstring's first paragraph (up to its first blank line), as one paragraph."""
    paragraphs = re.split(r"\n\s*\n", (module.__doc__ or "").strip())
    return " ".join(paragraphs[0].split())


def fail(message: str):
    """A user mistake outside an algorithm file's main (a bench/ tool, common.plot): one line, exit 2."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, exit 2 (argparse's own also prints the usage). The bench/ tools
    use it too."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _finite_float(text: str) -> float:
    """A float option's value: nan and inf are refused (no option means them; they would train on NaN)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, but an empty one: its comment says what empty means."""

    def _get_help_string(self, action):
        return action.help if action.default == "" else super()._get_help_string(action)


def parse(cls, argv=None):
    """Build a command line from the dataclass `cls` and return an instance filled from `argv`."""
    helps = _field_comments(cls)
    choices = getattr(cls, "choices", {})
    p = OneLineParser(description=_description(sys.modules[cls.__module__]),
                       formatter_class=_DefaultsHelp)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = helps.get(f.name, "").replace("%", "%%")  # argparse %-formats help; "50%" would raise
        kw = dict(default=f.default, help=help_text or "(default: %(default)s)", dest=f.name)  # blank: not shown
        typ = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type), str)
        typ = _finite_float if typ is float else typ
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            p.add_argument(flag, type=typ, choices=choices.get(f.name), metavar=f.name.upper(), **kw)
    return cls(**vars(p.parse_args(argv)))


def check(condition: bool, option: str, expected: str):
    """Refuse an impossible option value with a one-line message naming it."""
    if not condition:
        raise ConfigError(f"--{option.replace('_', '-')}: expected {expected}")


# What a run stopped with Ctrl-C leaves behind, one sentence for main_guard's last line: common/checkpoint.py's
# open_run sets it once the run has a folder (before that, nothing was written)
interrupt_note = None


def main_guard(main):
    """Run `main()`; a user mistake (bad option, path, data line, model folder) prints one line and exits 2."""
    try:
        return main()
    except (ConfigError, ModelError, DataError) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except RunError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        note = interrupt_note() if interrupt_note else "Nothing was written"
        sys.stderr.write(f"interrupted. {note}\n")
        sys.exit(130)
