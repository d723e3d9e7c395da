"""The Kubernetes manifest and image recipe in deploy/: well-formed, wired together, and the speculative config they
pass is one the plugin accepts (checked with the plugin's own parser against vLLM's SpeculativeConfig fields); and
clean under real tools: kubernetes-validate (strict schemas of pinned Kubernetes versions), checkov (policy) and
hadolint (Dockerfile), run from their own venv (scripts/install-deploy-tools.sh installs it on first use)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "k8s" / "ddtree-server.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
INSTALL_TOOLS = ROOT / "scripts" / "install-deploy-tools.sh"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"

# Kubernetes versions whose strict schemas (shipped in kubernetes-validate 1.37.0's wheel) the manifest must satisfy:
# the oldest and the newest minor release the managed clouds still run.
K8S_VERSIONS = ("1.33.0", "1.37.0")
# Every checkov skip that deploy/ carries, each justified where it stands; a new skip must be added here too, so it is
# reviewed rather than slipped in.
CHECKOV_SKIPS = {
    ("kubernetes", "CKV_K8S_21", "ConfigMap.default.ddtree-config"),
    ("kubernetes", "CKV_K8S_21", "Deployment.default.vllm-ddtree"),
    ("kubernetes", "CKV_K8S_21", "Service.default.vllm-ddtree"),
    ("kubernetes", "CKV_K8S_43", "Deployment.default.vllm-ddtree"),
    ("kubernetes", "CKV_K8S_15", "Deployment.default.vllm-ddtree"),
    ("dockerfile", "CKV_DOCKER_7", "/Dockerfile."),
}
# The policies the deployment is held to: these must have run and passed, not merely not failed (a check that stops
# matching the files would otherwise vanish silently).
CHECKOV_REQUIRED = {
    "kubernetes": {
        "CKV_K8S_8",  # liveness probe
        "CKV_K8S_9",  # readiness probe
        "CKV_K8S_10",  # CPU requests
        "CKV_K8S_11",  # CPU limits
        "CKV_K8S_12",  # memory requests
        "CKV_K8S_13",  # memory limits
        "CKV_K8S_16",  # not privileged
        "CKV_K8S_20",  # no privilege escalation
        "CKV_K8S_22",  # read-only root filesystem
        "CKV_K8S_23",  # non-root
        "CKV_K8S_28",  # no NET_RAW
        "CKV_K8S_29",  # pod security context
        "CKV_K8S_30",  # container security context
        "CKV_K8S_31",  # seccomp RuntimeDefault
        "CKV_K8S_37",  # capabilities dropped
        "CKV_K8S_38",  # no service-account token
        "CKV_K8S_40",  # high UID
        "CKV2_K8S_6",  # a NetworkPolicy selects the pod
    },
    "dockerfile": {
        "CKV_DOCKER_2",  # HEALTHCHECK
        "CKV_DOCKER_3",  # a user is created
        "CKV_DOCKER_8",  # the last USER is not root
    },
}


def _docs() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_manifest_objects_are_wired_together() -> None:
    docs = _docs()
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy"}
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
    from vllm_ddtree.patches import versions

    text = DOCKERFILE.read_text()
    base = re.search(r"ARG BASE_IMAGE=vllm/vllm-openai:v(\S+)", text)
    assert base and versions.supported_release(base.group(1), "cuda"), "the image must carry a vLLM the plugin accepts"
    assert "--no-deps /opt/vllm-ddtree" in text  # never a second vLLM or torch
    for src in re.findall(r"^COPY (.+) /opt/vllm-ddtree", text, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    image = _docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("vllm-ddtree:")


def _image_env(dockerfile: str) -> dict[str, str]:
    """The NAME=value pairs of the Dockerfile's ENV instructions (continuation lines included), which the pod's
    mounts must match."""
    env_text = " ".join(re.findall(r"^ENV ((?:[^\n]*\\\n)*[^\n]*)", dockerfile, flags=re.M))
    return dict(re.findall(r"\b([A-Z_]+)=(\S+)", env_text))


def test_pod_runs_unprivileged_on_a_read_only_root_with_writable_scratch() -> None:
    """What readOnlyRootFilesystem and the non-root user need to work, checked against the image recipe: the UID the
    image creates, and a writable volume at every place the server writes (HOME's caches, /tmp, /dev/shm, the
    kernel build cache the image sets)."""
    docs = _docs()
    text = DOCKERFILE.read_text()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (init,) = pod["initContainers"]
    user = re.findall(r"^USER (\d+):(\d+)$", text, flags=re.M)
    assert user and int(user[-1][0]) >= 10000, "the image must end on a numeric non-root USER with a high UID"
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and (str(ctx["runAsUser"]), str(ctx["runAsGroup"])) == user[-1]
    assert pod["automountServiceAccountToken"] is False
    for c in (container, init):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    image_env = _image_env(text)
    home = env["HOME"]
    assert image_env["HOME"] == home
    kernel_cache = image_env["VLLM_DDTREE_CACHE"]
    for path in (home, "/tmp", "/dev/shm", kernel_cache):
        assert path in mounts and "emptyDir" in volumes[mounts[path]], f"{path} needs a writable emptyDir"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert all("sizeLimit" in v["emptyDir"] for v in volumes.values() if "emptyDir" in v)
    # the init container fills the kernel volume from the image's copy at that same path
    (init_mount,) = init["volumeMounts"]
    assert init_mount["name"] == mounts[kernel_cache] and kernel_cache in init["command"][-1]
    assert init["image"] == container["image"]


def test_probes_wait_for_the_model() -> None:
    """Readiness and liveness only start after the startup probe lets through, which allows model loading and CUDA
    graph capture 30 minutes; vLLM's /health answers only once the engine is up, 503 once it has died."""
    (container,) = _docs()["Deployment"]["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        assert container[probe]["timeoutSeconds"] < container[probe]["periodSeconds"]


def test_network_policy_admits_only_the_http_port() -> None:
    docs = _docs()
    pod = docs["Deployment"]["spec"]["template"]
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == [docs["Service"]["spec"]["ports"][0]["targetPort"]]


# --- the real tools ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools() -> Path:
    """The deploy-lint venv's bin/, from the repository's own install script (a fresh CI clone installs it here).
    A missing or broken tool fails: a skipped lint would read as a passed one."""
    proc = subprocess.run(["bash", str(INSTALL_TOOLS)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"scripts/install-deploy-tools.sh failed (exit {proc.returncode}):\n{proc.stderr}")
    bin_dir = Path(proc.stdout.strip()) / "bin"
    missing = [t for t in ("kubernetes-validate", "checkov", "hadolint") if not (bin_dir / t).is_file()]
    if missing:
        pytest.fail(f"scripts/install-deploy-tools.sh left no {missing} in {bin_dir}")
    return bin_dir


def _run(argv: list[str | Path], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Runs a tool from the repository root, offline, with no user or environment configuration of the tools leaking
    in (HADOLINT_*, CKV_*, BC_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HADOLINT_", "CKV_", "BC_", "CHECKOV_"))}
    env["BC_SKIP_MAPPING"] = "TRUE"  # checkov: no fetch of the platform's check metadata (there is no network)
    return subprocess.run(
        [str(a) for a in argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    """The whole of a tool's run, for an assertion message."""
    cmd = " ".join(proc.args)
    return f"$ {cmd}\n(exit {proc.returncode})\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifest_passes_kubernetes_validate_strict(tools: Path, version: str) -> None:
    proc = _run([tools / "kubernetes-validate", "--strict", "--kubernetes-version", version, MANIFEST])
    assert proc.returncode == 0, _output(proc)
    passed = [line for line in proc.stdout.splitlines() if line.startswith("INFO") and " passed " in line]
    assert len(passed) == len(_docs()), _output(proc)  # every object validated, none missed
    assert all(f"against version {version.rsplit('.', 1)[0]}" in line for line in passed), _output(proc)
    assert "WARN" not in proc.stdout + proc.stderr, _output(proc)


def test_kubernetes_validate_rejects_an_unknown_field(tools: Path, tmp_path: Path) -> None:
    """The strict mode is real: a misspelt field (`resource:` for `resources:`) fails, as the API server would."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"cpu": "1"}}
    bad = tmp_path / "typo.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    proc = _run([tools / "kubernetes-validate", "--strict", "--kubernetes-version", K8S_VERSIONS[0], bad])
    assert proc.returncode != 0 and "'resource' was unexpected" in proc.stdout + proc.stderr, _output(proc)


def test_deploy_files_pass_checkov(tools: Path) -> None:
    proc = _run(
        [tools / "checkov", "--directory", "deploy", "--framework", "kubernetes", "dockerfile", "--skip-download"]
        + ["--output", "json"]
    )
    try:
        parsed = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON report\n{_output(proc)}")
    reports = {r["check_type"]: r for r in (parsed if isinstance(parsed, list) else [parsed])}
    failed = [
        f"{kind}: {c['check_id']} {c['check_name']} -- {c['resource']} ({c['file_path']}:{c['file_line_range']})"
        for kind, r in reports.items()
        for c in r["results"]["failed_checks"]
    ]
    assert not failed and proc.returncode == 0, "checkov findings:\n" + "\n".join(failed) + "\n" + _output(proc)
    assert set(reports) == set(CHECKOV_REQUIRED), _output(proc)
    skipped = set()
    for kind, r in reports.items():
        assert r["summary"]["parsing_errors"] == 0 and r["summary"]["resource_count"] > 0, (kind, r["summary"])
        passed = {c["check_id"] for c in r["results"]["passed_checks"]}
        assert CHECKOV_REQUIRED[kind] <= passed, f"{kind}: did not pass {sorted(CHECKOV_REQUIRED[kind] - passed)}"
        for c in r["results"]["skipped_checks"]:
            reason = c["check_result"].get("suppress_comment", "")
            assert reason.strip() and reason != "No comment provided", f"{c['check_id']} skipped without a reason"
            skipped.add((kind, c["check_id"], c["resource"]))
    assert skipped == CHECKOV_SKIPS, f"unreviewed or stale skips: {sorted(skipped ^ CHECKOV_SKIPS)}"


def test_dockerfile_passes_hadolint(tools: Path) -> None:
    """Every hadolint finding fails (.hadolint.yaml: failure-threshold style); an inline ignore needs a reason."""
    for line in DOCKERFILE.read_text().splitlines():
        ignore = re.search(r"#\s*hadolint\s+ignore=\S+(.*)", line)
        assert not ignore or ignore.group(1).strip(" #:-"), f"hadolint ignore without a reason: {line}"
    proc = _run([tools / "hadolint", "--config", HADOLINT_CONFIG, "--format", "json", DOCKERFILE])
    assert proc.returncode == 0, _output(proc)
    assert json.loads(proc.stdout) == [], _output(proc)
