"""cli/common.py: the help formatter and duration flags with hidden deprecated spellings."""

from __future__ import annotations

import argparse

import pytest

from decodeservice.cli.common import HelpFormatter, add_seconds_option, subcommand_kwargs


def parser_with_seconds() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodectl x", **subcommand_kwargs())
    add_seconds_option(parser, "--drain-timeout-seconds", default=30.0, help="how long SIGTERM waits",
                       deprecated=("--drain-timeout",))
    return parser


def test_the_new_spelling_parses_and_shows_its_default() -> None:
    parser = parser_with_seconds()
    assert parser.parse_args([]).drain_timeout_seconds == 30.0
    assert parser.parse_args(["--drain-timeout-seconds", "2.5"]).drain_timeout_seconds == 2.5
    text = parser.format_help()
    assert "--drain-timeout-seconds SECONDS" in text and "(default: 30.0)" in text


def test_the_old_spelling_still_works_hidden_and_warns(capsys: pytest.CaptureFixture[str]) -> None:
    parser = parser_with_seconds()
    assert parser.parse_args(["--drain-timeout", "7"]).drain_timeout_seconds == 7.0
    assert "--drain-timeout is deprecated; use --drain-timeout-seconds" in capsys.readouterr().err
    assert "--drain-timeout " not in parser.format_help().replace("--drain-timeout-seconds", "")
    with pytest.raises(SystemExit):
        parser.parse_args(["--drain-timeout", "soon"])  # the alias keeps the flag's type


def test_a_duration_flag_must_say_seconds() -> None:
    with pytest.raises(ValueError, match="--NAME-seconds"):
        add_seconds_option(argparse.ArgumentParser(), "--drain-timeout", default=1.0, help="x")


def test_the_formatter_adds_defaults_once() -> None:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--a", default=3, help="plain")
    parser.add_argument("--b", default=None, help="worded (default: the model's)")
    parser.add_argument("--c", action="store_true", help="a switch")
    parser.add_argument("--d", required=True, help="needed")
    parser.add_argument("--e", default=None, help="optional")
    text = " ".join(parser.format_help().split())
    assert "plain (default: 3)" in text
    assert "worded (default: the model's)" in text and text.count("default") == 4
    assert "a switch (default: off)" in text and "optional (default: unset)" in text
    assert "needed (default" not in text
