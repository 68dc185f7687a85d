"""The Kubernetes manifests in docs/ against the Kubernetes API's own schemas (strict:
an unknown or misspelt field is an error), as `kubectl apply --dry-run` would check them.

The cert-manager resources of docs/scale.md (Issuer, Certificate) are custom resources:
their schemas come with cert-manager, not with Kubernetes. They are checked against
cert-manager's own API types (cloudcoil's models of its CRDs: field types and allowed
values), strictly too: a field the models do not know is dropped by them, so a resource
must come back from its model unchanged.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pydantic
import pytest
import yaml
from cloudcoil.models.cert_manager import v1 as cert_manager

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/remote.md", "docs/training.md", "docs/scale.md")
CUSTOM = {"cert-manager.io/v1"}  # API groups whose schemas Kubernetes does not hold
# the oldest Kubernetes the manifests are written for, and the newest schemas at hand
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _manifests() -> list[tuple[str, dict]]:
    """(where: "file:line kind/name", resource) of every YAML block with an apiVersion."""
    found = []
    for doc in DOCS:
        text = (REPO_ROOT / doc).read_text()
        for block in re.finditer(r"```yaml\n(.*?)```", text, re.S):
            line = text[: block.start()].count("\n") + 2
            for resource in yaml.safe_load_all(block.group(1)):
                if resource and "apiVersion" in resource:
                    name = resource.get("metadata", {}).get("name", "?")
                    found.append((f"{doc}:{line} {resource['kind']}/{name}", resource))
    return found


MANIFESTS = _manifests()


def test_the_docs_have_the_manifests_they_describe():
    kinds = sorted(resource["kind"] for _, resource in MANIFESTS)
    assert kinds.count("StatefulSet") == 1 and kinds.count("Job") == 2
    assert kinds.count("Service") == 2 and "Certificate" in kinds


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("where", "resource"),
    [m for m in MANIFESTS if m[1]["apiVersion"] not in CUSTOM],
    ids=[m[0] for m in MANIFESTS if m[1]["apiVersion"] not in CUSTOM],
)
def test_a_manifest_follows_the_kubernetes_schema(where, resource, version):
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{where}: {error.message} at {'.'.join(map(str, error.path))}")


def test_the_check_finds_a_misspelt_field_and_a_wrong_type():
    statefulset = next(r for _, r in MANIFESTS if r["kind"] == "StatefulSet")
    misspelt = copy.deepcopy(statefulset)
    misspelt["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    wrong_type = copy.deepcopy(statefulset)
    wrong_type["spec"]["replicas"] = "two"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def _check_cert_manager(resource: dict) -> None:
    """Raises ValueError unless `resource` is a valid cert-manager.io/v1 object whose every
    field cert-manager knows."""
    model = getattr(cert_manager, resource["kind"], None)
    if model is None:
        raise ValueError(f"cert-manager.io/v1 has no kind {resource['kind']!r}")
    try:
        parsed = model.model_validate(resource)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        raise ValueError(f"{first['msg']} at {'.'.join(map(str, first['loc']))}") from None
    back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if back != resource:
        unknown = _first_difference(resource, back)
        raise ValueError(f"unknown field {unknown}")


def _first_difference(given, known, path: str = "") -> str:
    if isinstance(given, dict) and isinstance(known, dict):
        for key, value in given.items():
            if key not in known:
                return f"{path}{key}"
            if value != known[key]:
                return _first_difference(value, known[key], f"{path}{key}.")
    if isinstance(given, list) and isinstance(known, list):
        for index, (value, back) in enumerate(zip(given, known, strict=False)):
            if value != back:
                return _first_difference(value, back, f"{path}{index}.")
    return path.rstrip(".") or "(the whole resource)"


@pytest.mark.parametrize(
    ("where", "resource"),
    [m for m in MANIFESTS if m[1]["apiVersion"] in CUSTOM],
    ids=[m[0] for m in MANIFESTS if m[1]["apiVersion"] in CUSTOM],
)
def test_a_cert_manager_resource_follows_cert_managers_api(where, resource):
    try:
        _check_cert_manager(resource)
    except ValueError as error:
        pytest.fail(f"{where}: {error}")


def test_the_cert_manager_check_finds_a_misspelt_field_and_a_wrong_value():
    certificate = next(r for _, r in MANIFESTS if r["kind"] == "Certificate")
    misspelt = copy.deepcopy(certificate)
    misspelt["spec"]["renewBefor"] = misspelt["spec"].pop("renewBefore")
    nested = copy.deepcopy(certificate)
    nested["spec"]["privateKey"]["bits"] = 256
    wrong_value = copy.deepcopy(certificate)
    wrong_value["spec"]["usages"] = ["server-auth"]
    with pytest.raises(ValueError, match="unknown field spec.renewBefor"):
        _check_cert_manager(misspelt)
    with pytest.raises(ValueError, match="unknown field spec.privateKey.bits"):
        _check_cert_manager(nested)
    with pytest.raises(ValueError, match="at spec.usages.0"):
        _check_cert_manager(wrong_value)
