"""What every `decodectl` subcommand shares: the help formatter, `--log-level`, seconds flags, usage errors.

A subcommand adopts them in `register`:

    parser = subparsers.add_parser("NAME", help=..., description=__doc__, **subcommand_kwargs())
    add_seconds_option(parser, "--drain-timeout-seconds", default=30.0, help="...",
                       deprecated=("--drain-timeout",))

`subcommand_kwargs()` gives the shared parent parser (`--log-level`) and the formatter (every option's
default in `--help`, the description's own line breaks kept). Torch-free and quick to import: `decodectl
--help` imports every subcommand's `register`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_LOG_LEVEL = "info"
SECONDS_SUFFIX = "-seconds"  # the one spelling of a duration flag: --resync-seconds, --drain-timeout-seconds


class UsageError(Exception):
    """Bad command-line input: printed as `decodectl COMMAND: error: ...` with exit code 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default; a description with line breaks keeps them.

    Help text that already names its default (it says "default") is left alone, so a default that is
    not a plain value ("the model's own", "--model") can be worded by hand. A one-paragraph description
    is wrapped to the terminal; a module docstring with examples is printed as written.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is argparse.SUPPRESS or "default" in text.lower() or not action.option_strings:
            return text
        if action.required or isinstance(action, argparse._HelpAction | argparse._VersionAction):
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            shown = "on" if action.default else "off"
        elif action.default is None:
            shown = "unset"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def common_parent() -> argparse.ArgumentParser:
    """The parent parser of every subcommand: the options each of them takes."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("common options")
    group.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, choices=LOG_LEVELS, type=str.lower,
                       help="log verbosity")
    return parent


def subcommand_kwargs() -> dict[str, Any]:
    """`add_parser` keyword arguments for a subcommand: the shared parent and formatter."""
    return {"parents": [common_parent()], "formatter_class": HelpFormatter}


def has_option(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def ensure_common_options(parser: argparse.ArgumentParser) -> None:
    """Give a subcommand built without `subcommand_kwargs()` the formatter and common options it lacks.

    A parser with actions of its own (`models list|pull`) gets only the formatter: its actions carry
    the options (given to both, the action's default would overwrite the group's value).
    """
    parser.formatter_class = HelpFormatter
    for action in parser._actions:  # argparse prints nothing, so no default, for an option without help
        if action.option_strings and action.help is None and not action.required:
            action.help = "(default: unset)" if action.default is None else "(default: %(default)s)"
    if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        return
    if not has_option(parser, "--log-level"):
        for action in common_parent()._actions:
            if action.option_strings:
                parser._add_action(action)


def configure_logging(level: str) -> None:
    """The project's loggers (`decodeservice.*`) at `--log-level`, to stderr.

    Only ours: the root logger stays as it is, so libraries' INFO lines (httpx logs every request) do not
    reach a server's hot path. The servers pass the same level to uvicorn; kopf takes its own setting.
    """
    logger = logging.getLogger("decodeservice")
    logger.setLevel(getattr(logging, level.upper()))
    if not any(getattr(h, "name", None) == _HANDLER for h in logger.handlers):
        handler = _StderrHandler()
        handler.name = _HANDLER
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


_HANDLER = "decodectl"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes (a test's capture, a redirected stream)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest and says what to use instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_seconds_option(parser: argparse.ArgumentParser | Any, flag: str, *, default: float | None,
                       help: str, deprecated: Sequence[str] = (), type: Any = float,
                       dest: str | None = None) -> argparse.Action:
    """A duration flag spelled `--NAME-seconds`; each `deprecated` spelling still works, hidden from --help."""
    if not flag.startswith("--") or not flag.endswith(SECONDS_SUFFIX):
        raise ValueError(f"duration flags are spelled --NAME{SECONDS_SUFFIX}, not {flag}")
    action = parser.add_argument(flag, type=type, default=default, metavar="SECONDS", help=help, dest=dest)
    for old in deprecated:
        parser.add_argument(old, type=type, dest=action.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                            action=_DeprecatedAlias, replacement=flag)
    return action
