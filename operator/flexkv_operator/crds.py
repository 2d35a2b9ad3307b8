"""The packaged CRD manifests (``crds/*.yaml``) and their schemas.

These YAML files are the single source of truth: the Helm chart copies them and
:mod:`flexkv_operator.defaults` reads the defaults from them.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml

from node_agent.contract import kube

GROUP = kube.CRD_GROUP
VERSION = kube.CRD_VERSION
API_VERSION = kube.API_VERSION
POOL_PLURAL = kube.POOL_PLURAL
GROUP_PLURAL = kube.GROUP_PLURAL
POOL_KIND = kube.POOL_KIND
GROUP_KIND = kube.GROUP_KIND

CRD_FILES = {
    POOL_PLURAL: "kvcachepools.flexkv.io.yaml",
    GROUP_PLURAL: "kvcachegroups.flexkv.io.yaml",
}


@functools.cache
def load_crd(plural: str) -> dict[str, Any]:
    """Return the CRD manifest for ``plural`` (``kvcachepools`` or ``kvcachegroups``)."""
    try:
        filename = CRD_FILES[plural]
    except KeyError:
        raise ValueError(
            f"No CRD for plural {plural!r}; known plurals are {sorted(CRD_FILES)}"
        ) from None
    text = resources.files("flexkv_operator").joinpath("crds", filename).read_text()
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


def schema(plural: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served version of ``plural``."""
    crd = load_crd(plural)
    for version in crd["spec"]["versions"]:
        if version["name"] == VERSION:
            result: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return result
    raise LookupError(f"CRD {crd['metadata']['name']} does not serve version {VERSION}")
