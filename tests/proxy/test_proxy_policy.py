"""The policy schema: defaults, camelCase round trip, clear errors, partial classes."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from decodeservice.proxy.policy import LengthMode, Policy, PolicyError, PriorityClass


def test_empty_file_and_empty_mapping_are_the_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "policy.yaml"
    empty.write_text("")
    policy = Policy.from_yaml_file(empty)
    assert policy == Policy.from_mapping({}) == Policy()
    assert policy.output_length.max_output_tokens == 2048 and policy.output_length.mode is LengthMode.CLAMP
    assert policy.output_length.default_max_tokens == 256 and policy.output_length.max_input_tokens is None
    assert policy.output_length.max_body_bytes == 1_048_576
    assert (policy.slo.ttft_ms, policy.slo.itl_ms, policy.slo.percentile, policy.slo.window_seconds) == (
        1000, 200, 95, 60)
    assert policy.admission.default_class is PriorityClass.INTERACTIVE
    assert policy.admission.max_inflight == 64 and policy.admission.tenant_tokens_per_minute is None
    assert (policy.classes.interactive.batch_window_ms, policy.classes.interactive.max_batch,
            policy.classes.interactive.max_queue) == (0, 1, 64)
    assert (policy.classes.batch.batch_window_ms, policy.classes.batch.max_batch,
            policy.classes.batch.max_queue) == (20, 16, 256)


def test_yaml_round_trip_uses_camel_case() -> None:
    text = Policy().to_yaml()
    for key in ("outputLength:", "maxOutputTokens:", "defaultMaxTokens:", "ttftMs:", "tenantTokensPerMinute:",
                "batchWindowMs:", "maxQueue:"):
        assert key in text
    custom = Policy.from_yaml("outputLength: {mode: reject}\nadmission: {tenantTokensPerMinute: 1000}\n")
    assert Policy.from_yaml(custom.to_yaml()) == custom
    assert custom.to_dict()["admission"]["tenantTokensPerMinute"] == 1000


def test_partial_class_keeps_that_class_defaults() -> None:
    policy = Policy.from_mapping({"classes": {"batch": {"maxQueue": 3}}})
    assert (policy.classes.batch.batch_window_ms, policy.classes.batch.max_batch, policy.classes.batch.max_queue) == (
        20, 16, 3)
    assert policy.classes.interactive == Policy().classes.interactive


@pytest.mark.parametrize("text, expected", [
    ("outputLength: {maxOutputTokens: 10}", "defaultMaxTokens (256) must be <= maxOutputTokens (10)"),
    ("outputLength: {mode: truncate}", "outputLength.mode: Input should be 'clamp' or 'reject'"),
    ("slo: {percentile: 101}", "slo.percentile: Input should be less than or equal to 100"),
    ("slo: {percentile: 0}", "slo.percentile: Input should be greater than 0"),
    ("slo: {ttftMs: 0}", "slo.ttftMs: Input should be greater than 0"),
    ("admission: {defaultClass: bulk}", "admission.defaultClass: Input should be 'interactive' or 'batch'"),
    ("classes: {batch: {maxBatch: 0}}", "classes.batch.maxBatch: Input should be greater than or equal to 1"),
    ("classes: {realtime: {}}", "classes.realtime: unknown field"),
    ("slos: {}", "slos: unknown field"),
    ("- a\n- b", "expected a mapping at the top level, got list"),
    ("a: [", "not valid YAML"),
])
def test_bad_policies_name_the_field(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_yaml(text, source="policy.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("policy.yaml:")


def test_policy_is_frozen_and_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError):
        Policy().slo.ttft_ms = 5  # type: ignore[misc]
    with pytest.raises(PolicyError, match="cannot read policy file"):
        Policy.from_yaml_file(tmp_path / "missing.yaml")


def test_json_schema_for_the_crd_is_camel_case() -> None:
    schema = Policy.model_json_schema(by_alias=True)
    assert set(schema["properties"]) == {"outputLength", "slo", "admission", "classes"}
    assert "maxOutputTokens" in schema["$defs"]["OutputLengthPolicy"]["properties"]
    assert schema["$defs"]["OutputLengthPolicy"]["additionalProperties"] is False
