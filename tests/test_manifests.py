"""The Kubernetes manifests in docs/ against the Kubernetes API's own schemas (strict:
an unknown or misspelt field is an error), as `kubectl apply --dry-run` would check them.

The cert-manager resources of docs/scale.md (Issuer, Certificate) are custom resources:
their schemas come with cert-manager, not with Kubernetes, and are not checked here.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

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
