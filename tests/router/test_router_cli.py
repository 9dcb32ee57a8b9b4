"""`decodectl router`: bad flags get a message and exit code 2."""

from __future__ import annotations

import pytest

from decodeservice.cli.main import main


@pytest.mark.parametrize(("argv", "message"), [
    ([], "one of the arguments --endpoints --service is required"),
    (["--endpoints", "http://a:1", "--service", "x"], "not allowed with argument"),
    (["--endpoints", "ftp://a:1"], "is not an http(s) URL"),
    (["--endpoints", ","], "needs at least one URL"),
    (["--endpoints", "http://a:1,http://a:1"], "lists a URL twice"),
    (["--endpoints", "http://a:1", "--block-size", "12"], "--block-size must be a positive power of two"),
    (["--endpoints", "http://a:1", "--max-held", "-1"], "--max-held must be >= 0"),
    (["--endpoints", "http://a:1", "--hold-seconds", "-2"], "--hold-seconds must be >= 0"),
    (["--endpoints", "http://a:1", "--scrape-interval-seconds", "0"], "--scrape-interval-seconds must be > 0"),
    (["--endpoints", "http://a:1", "--port", "70000"], "--port must be in 1..65535"),
    (["--endpoints", "http://a:1", "--policy", "/nonexistent/policy.yaml"], "cannot read policy file"),
])
def test_bad_flags_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "decodectl router" in err and message in err


def test_service_mode_outside_a_pod_needs_a_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", "--service", "chat-pods"])
    assert exited.value.code == 2
    assert "--namespace is needed outside a pod" in capsys.readouterr().err


def test_service_mode_outside_a_pod_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", "--service", "chat-pods", "--namespace", "prod"])
    assert exited.value.code == 2
    assert "from inside a pod" in capsys.readouterr().err
