"""The Kubernetes manifest and image recipe in deploy/: well-formed, wired together, and the speculative config they
pass is one the plugin accepts (checked with the plugin's own parser against vLLM's SpeculativeConfig fields)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "k8s" / "ddtree-server.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _docs() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_manifest_objects_are_wired_together() -> None:
    docs = _docs()
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service"}
    dep = docs["Deployment"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert docs["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] in port_names
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health" and container[probe]["httpGet"]["port"] in port_names
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert container["envFrom"][0]["configMapRef"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_manifest_speculative_config_is_accepted_by_the_plugin() -> None:
    pytest.importorskip("vllm")
    from vllm.config import SpeculativeConfig

    from vllm_ddtree.config import resolve_ddtree_config, split_speculative_config

    docs = _docs()
    env = dict(docs["ConfigMap"]["data"])
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = [_expand(a, env) for a in container["args"]]
    assert container["command"][:2] == ["vllm", "serve"]
    spec_arg = next(a for a in args if a.startswith("--speculative-config="))
    raw = json.loads(spec_arg.split("=", 1)[1])
    vllm_spec, request = split_speculative_config(raw, [f.name for f in dataclasses.fields(SpeculativeConfig)])
    assert vllm_spec["method"] == "dflash" and vllm_spec["model"].startswith("/models/")
    ddtree = resolve_ddtree_config(request, block_size=16)
    assert ddtree.width == raw["num_speculative_tokens"] + 1
    tp = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--tensor-parallel-size="))
    assert tp == int(container["resources"]["limits"]["nvidia.com/gpu"])


def test_image_recipe_pins_the_supported_vllm_and_installs_the_plugin() -> None:
    from vllm_ddtree.plugin import is_supported_version

    text = DOCKERFILE.read_text()
    base = re.search(r"ARG BASE_IMAGE=vllm/vllm-openai:v(\S+)", text)
    assert base and is_supported_version(base.group(1)), "the image must carry the vLLM version the plugin accepts"
    assert "--no-deps /opt/vllm-ddtree" in text  # never a second vLLM or torch
    for src in re.findall(r"^COPY (.+) /opt/vllm-ddtree", text, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    image = _docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("vllm-ddtree:")
