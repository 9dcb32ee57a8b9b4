"""The operator tests' API emulator fixture, for the operator-metrics end-to-end test."""

from tests.operator.conftest import cluster  # noqa: F401 (a fixture, found by name)
