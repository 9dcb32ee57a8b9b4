"""The benchmark's exception tree. The CLI turns every `BenchError` into a clear message and exit code 2."""

from __future__ import annotations


class BenchError(Exception):
    """Base of every error the benchmark raises on purpose."""


class BenchConfigError(BenchError, ValueError):
    """Bad options: an unparsable SLO, load level, max-tokens spec, or a bad dataset file."""


class ServerError(BenchError):
    """The server cannot be reached or answers something that is not an OpenAI-compatible API."""


class DemoError(BenchError):
    """A demo subprocess failed to start, died, or never became ready."""
