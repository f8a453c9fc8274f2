"""The shipped Kubernetes components rendered as a user renders them (``kubectl kustomize``), for the tests that
check the manifests and those that run the sidecar as a rendered manifest says."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl missing (it comes with the machine image; kustomize is built into it)"
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def overlay(path: Path, *components: str) -> Path:
    """A kustomization of the plain vLLM Deployment with the named components of deploy/kubernetes/components."""
    path.mkdir()
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "vllm", path)],  # kustomize takes other kustomizations by relative path
        "components": [os.path.relpath(K8S / "components" / c, path) for c in components],
    }
    (path / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return path


def sidecars(docs: list[dict]) -> list[dict]:
    """The vllm-capacity native sidecars of the rendered Deployments."""
    return [
        c
        for d in docs
        if d.get("kind") == "Deployment"
        for c in d["spec"]["template"]["spec"].get("initContainers", [])
        if c["name"] == "vllm-capacity"
    ]
