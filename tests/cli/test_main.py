"""`decodectl` as a whole: --version, the top-level help, usage errors, the common options."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from importlib.metadata import version

import pytest

from decodeservice.cli.main import SUBCOMMANDS, build_parser, main

LEAVES = (*[c for c in SUBCOMMANDS if c != "models"], "models list", "models pull")


def decodectl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "decodeservice.cli.main", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def subparser(path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in path.split():
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[word]
    return parser


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"decodectl {version('decodeservice')}"


def test_top_level_help_says_what_the_tool_is() -> None:
    result = decodectl("--help")
    assert result.returncode == 0
    assert "serve LLMs on Kubernetes" in result.stdout and "DecodeService" in result.stdout
    for name in SUBCOMMANDS:
        assert f"    {name}" in result.stdout


@pytest.mark.parametrize("command", [*SUBCOMMANDS, "models list", "models pull"])
def test_a_bad_flag_prints_the_subcommands_usage(command: str, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command.split(), "--no-such-flag"])
    assert exc.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith(f"usage: decodectl {command} ")  # its own usage, not the top level's
    assert f"decodectl {command}: error: " in err  # the unknown flag, or a required one missing first
    if command in ("demo", "models list", "operator"):
        assert "unrecognized arguments: --no-such-flag" in err


def test_a_bad_value_exits_2_naming_the_flag(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["render", "-f", "x.yaml", "-o", "toml"])
    assert exc.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("usage: decodectl render ") and "argument -o/--output: invalid choice: 'toml'" in err


@pytest.mark.parametrize("command", LEAVES)
def test_every_subcommand_takes_log_level(command: str) -> None:
    parser = subparser(command)
    action = parser._option_string_actions["--log-level"]
    assert action.default == "info"
    assert set(action.choices or ()) == {"critical", "error", "warning", "info", "debug"}


def test_log_level_sets_the_projects_loggers(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("decodeservice")
    before = logger.level
    try:
        assert main(["models", "list", "-o", "json", "--log-level", "DEBUG", "--cache-dir", str(tmp_path)]) == 0
        assert logger.level == logging.DEBUG
        assert main(["models", "list", "-o", "json", "--log-level", "error", "--cache-dir", str(tmp_path)]) == 0
        assert logger.level == logging.ERROR
        logging.getLogger("decodeservice.cli.test").error("seen at error")
        assert "seen at error" in capsys.readouterr().err
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("command", LEAVES)
def test_every_flag_shows_its_default(command: str) -> None:
    parser = subparser(command)
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.required or isinstance(action, argparse._HelpAction):
            continue
        if action.help is argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text.lower():
            missing.append(action.option_strings[0])
    assert missing == []
    assert "(default: info)" in " ".join(parser.format_help().split())  # --log-level, shared or its own


def test_models_list_json_through_the_dispatcher(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "-o", "json", "--cache-dir", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(row["default"] for row in rows)
