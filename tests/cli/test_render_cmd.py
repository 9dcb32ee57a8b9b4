"""`decodectl render -o yaml|json`: the same objects either way, YAML written out without anchors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from decodeservice.cli.main import main
from decodeservice.cli.render_cmd import dump

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def render(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["render", "-f", str(EXAMPLES / "cpu-smoke.yaml"), *args]) == 0
    return capsys.readouterr().out


def test_yaml_has_no_anchors_or_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    out = render(capsys)
    events = list(yaml.parse(out))
    assert not any(isinstance(e, yaml.AliasEvent) for e in events)
    assert not any(getattr(e, "anchor", None) for e in events)
    kinds = [d["kind"] for d in yaml.safe_load_all(out)]
    assert "Deployment" in kinds and "Service" in kinds


def test_json_is_a_v1_list_of_the_same_objects(capsys: pytest.CaptureFixture[str]) -> None:
    objects = list(yaml.safe_load_all(render(capsys, "-o", "yaml")))
    listed = json.loads(render(capsys, "-o", "json"))
    assert listed["apiVersion"] == "v1" and listed["kind"] == "List"
    assert listed["items"] == objects


def test_shared_objects_are_written_out_in_full() -> None:
    # The case PyYAML anchors: one dict referenced twice (a selector's labels in the pod template).
    labels = {"app": "x"}
    out = dump([{"a": labels, "b": labels}], output="yaml")
    assert "&" not in out and "*" not in out
    assert yaml.safe_load(out) == {"a": {"app": "x"}, "b": {"app": "x"}}


def test_a_routed_service_renders_its_router(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(EXAMPLES / "scale-to-zero.yaml")]) == 0
    objects = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(capsys.readouterr().out)}
    name = "smollm2-scale-to-zero"
    assert {("Deployment", f"{name}-router"), ("Service", f"{name}-pods"), ("ServiceAccount", f"{name}-router"),
            ("Role", f"{name}-router"), ("RoleBinding", f"{name}-router"),
            ("PodDisruptionBudget", f"{name}-router"), ("Service", name), ("Deployment", name)} <= objects


def test_a_routing_combination_that_cannot_serve_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = yaml.safe_load((EXAMPLES / "scale-to-zero.yaml").read_text())
    body["spec"]["routing"]["mode"] = "service"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(SystemExit) as exited:
        main(["render", "-f", str(path)])
    assert exited.value.code == 2
    assert "minReplicas: 0 needs routing.mode router" in capsys.readouterr().err
