"""engine, proxy and operator: duration flags spelled --NAME-seconds; the old spellings warn but still work."""

from __future__ import annotations

import argparse
import re

import pytest

from decodeservice.cli.main import build_parser, main

# (subcommand, arguments it requires, new flag, old flag, its dest)
RENAMED = [
    ("engine", [], "--drain-timeout-seconds", "--drain-timeout", "drain_timeout_seconds"),
    ("proxy", ["--upstream", "http://127.0.0.1:8001"], "--drain-timeout-seconds", "--drain-timeout",
     "drain_timeout_seconds"),
    ("operator", [], "--autoscale-interval-seconds", "--autoscale-interval", "autoscale_interval_seconds"),
]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def help_text(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(command, "--help")
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(("command", "required", "new", "old", "dest"), RENAMED)
def test_the_new_spelling_parses_quietly(command: str, required: list[str], new: str, old: str, dest: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(command, *required, new, "12.5")
    assert getattr(args, dest) == 12.5
    assert "deprecated" not in capsys.readouterr().err


@pytest.mark.parametrize(("command", "required", "new", "old", "dest"), RENAMED)
def test_the_old_spelling_still_parses_and_warns(command: str, required: list[str], new: str, old: str, dest: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    default = getattr(parse(command, *required), dest)
    args = parse(command, *required, old, "7")
    assert getattr(args, dest) == 7.0 != default
    assert f"decodectl {command}: warning: {old} is deprecated; use {new}" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "required", "new", "old", "dest"), RENAMED)
def test_help_lists_only_the_new_spelling(command: str, required: list[str], new: str, old: str, dest: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(command, capsys)
    assert f"{new} SECONDS" in text
    assert re.search(re.escape(old) + r"(?![-\w])", text) is None


@pytest.mark.parametrize("command", ["engine", "proxy", "operator"])
def test_every_flag_valued_in_seconds_says_so(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A flag shown with the SECONDS metavar is spelled --NAME-seconds, and --log-level is the shared one."""
    text = help_text(command, capsys)
    flags = re.findall(r"^\s+(--[\w-]+) SECONDS$", text, flags=re.MULTILINE)
    assert flags and all(flag.endswith("-seconds") for flag in flags)
    assert "common options:" in text and text.count("--log-level {") == 2  # usage line and the option itself
    assert parse(command, *dict((c, r) for c, r, *_ in RENAMED)[command], "--log-level", "DEBUG").log_level == "debug"


def test_the_engine_hands_either_spelling_to_its_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """`run` reads the renamed dest: a negative drain timeout is ServerSettings' usage error, before any model loads."""
    for flag in ("--drain-timeout-seconds", "--drain-timeout"):
        with pytest.raises(SystemExit) as exit_info:
            main(["engine", flag, "-1"])
        assert exit_info.value.code == 2
        assert "drain_timeout_s must be >= 0" in capsys.readouterr().err
