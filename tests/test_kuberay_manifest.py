"""The KubeRay manifest in docs/tpu.md can run (issue 29, finding 6).

It must be a RayCluster the API server accepts (validated here against KubeRay's own CRD schema,
vendored in tests/data/kuberay/ with its licence and version), its head and workers must run the
image the repository's Dockerfile builds (rltpu with the tpu extra on Ray's image at the pinned Ray
version), and their custom command must be one KubeRay keeps (the overwrite-container-cmd
annotation) and that still starts Ray. Docker is not run here: the Dockerfile is checked as text.
"""

import copy
import functools
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (requires-python >= 3.10)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "tests" / "data" / "kuberay"
CRD = KUBERAY / "ray.io_rayclusters.yaml"
OVERWRITE = "ray.io/overwrite-container-cmd"  # KubeRay utils.RayOverwriteContainerCmdAnnotationKey
GEN_CMD = "$KUBERAY_GEN_RAY_START_CMD"  # KubeRay's generated `ray start`, given to a kept command
REGISTRY = "us-docker.pkg.dev/example-project/rltpu"  # what a user substitutes for $REGISTRY


# -- the schema --------------------------------------------------------------------------------------

def _to_json_schema(node):
    """KubeRay's OpenAPI v3 (Kubernetes structural) schema as JSON Schema, as the API server applies it
    with kubectl's strict field validation: an object's unknown fields are errors unless it sets
    x-kubernetes-preserve-unknown-fields; ``nullable`` admits null; the other x-kubernetes-* keys
    (list/map types, int-or-string, which comes with its own anyOf) constrain nothing here. CEL rules
    (x-kubernetes-validations) cannot be run: ``_cel_paths`` lists them, and the test makes sure the
    manifest sets none of the fields they guard."""
    if isinstance(node, list):
        return [_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k.startswith("x-kubernetes-") or k == "nullable":
            continue
        if k == "properties":
            out[k] = {name: _to_json_schema(sub) for name, sub in v.items()}
        elif k in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[k] = _to_json_schema(v)
        else:
            out[k] = v
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _cel_paths(node, path=()):
    """Paths (tuples of field names, "*" for list items / map values) of the schema's CEL rules."""
    if not isinstance(node, dict):
        return []
    found = [path] if "x-kubernetes-validations" in node else []
    for name, sub in node.get("properties", {}).items():
        found += _cel_paths(sub, path + (name,))
    for k in ("items", "additionalProperties"):
        if isinstance(node.get(k), dict):
            found += _cel_paths(node[k], path + ("*",))
    return found


@functools.cache
def _crd_v1() -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayCluster"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return v1["schema"]["openAPIV3Schema"]


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    schema = _to_json_schema(_crd_v1())
    cls = jsonschema.validators.validator_for({"$schema": "http://json-schema.org/draft-07/schema#"})
    cls.check_schema(schema)
    return cls(schema)


def _errors(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(doc)]


# -- the documents -----------------------------------------------------------------------------------

def _manifest_text() -> str:
    text = (ROOT / "docs" / "tpu.md").read_text()
    return text.split("```yaml\n", 1)[1].split("```", 1)[0]  # the first yaml block, as test_tpu_path reads it


def _manifest(substituted: bool = True) -> dict:
    """The manifest as `envsubst '$REGISTRY'` hands it to kubectl (docs/tpu.md)."""
    text = _manifest_text()
    return yaml.safe_load(text.replace("$REGISTRY", REGISTRY) if substituted else text)


def _containers(doc: dict) -> list[dict]:
    spec = doc["spec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["containers"]]


def _dockerfile() -> list[str]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    lines, cur = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") and not cur:
            continue
        cur += raw.rstrip("\\").strip() + " " if raw.rstrip().endswith("\\") else raw.strip()
        if not raw.rstrip().endswith("\\"):
            if cur:
                lines.append(cur)
            cur = ""
    return lines


def _dockerfile_image() -> str:
    """The tag the Dockerfile says it is built as (its `# image:` line)."""
    (tag,) = re.findall(r"^# image: (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    return tag


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pin(name: str) -> str:
    (pin,) = [d.split("==", 1)[1] for d in _pyproject()["project"]["dependencies"] if d.startswith(f"{name}==")]
    return pin


# -- tests -------------------------------------------------------------------------------------------

def test_vendored_crd_is_the_file_its_readme_names():
    readme = (KUBERAY / "README.md").read_text()
    (sha,) = re.findall(r"sha256: `([0-9a-f]{64})`", readme)
    assert hashlib.sha256(CRD.read_bytes()).hexdigest() == sha
    assert "github.com/ray-project/kuberay" in readme and re.search(r"Tag: `v\d+\.\d+\.\d+`", readme)
    assert "Apache License" in (KUBERAY / "LICENSE").read_text()[:200]


def test_docs_manifest_is_a_valid_raycluster():
    doc = _manifest()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    assert _errors(doc) == []
    # CEL rules are not run here: the manifest must not set the fields they guard
    for path in _cel_paths(_crd_v1()):
        node = doc
        for part in path:
            node = node.get(part) if isinstance(node, dict) and part != "*" else None
            if node is None:
                break
        assert node is None, f"{'.'.join(path)} is set; its CEL rule is not checked here"


@pytest.mark.parametrize("breakage, where", [
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(numOfHost=1), "numOfHost"),  # typo: unknown field
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="1"), "replicas"),  # string for an integer
    (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),  # a required field
    (lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"), "name"),
    (lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
     .update({"google.com/tpu": "eight"}), "google.com/tpu"),  # not a quantity
    (lambda d: d["spec"].update(headGroupSpec={"rayStartParams": {}}), "template"),
    (lambda d: d["spec"].update(workerGroupSpec=d["spec"].pop("workerGroupSpecs")), "workerGroupSpec"),
])
def test_the_validator_rejects_broken_copies(breakage, where):
    """The schema check can fail: each broken copy of the manifest is rejected, naming the field."""
    doc = copy.deepcopy(_manifest())
    breakage(doc)
    errs = _errors(doc)
    assert errs and any(where in e for e in errs), errs


def test_head_and_workers_run_the_image_the_dockerfile_builds():
    image = _dockerfile_image()
    assert re.fullmatch(r"\$REGISTRY/rltpu:" + re.escape(_pyproject()["project"]["version"]), image), image
    doc = _manifest(substituted=False)
    images = {c["image"] for c in _containers(doc)}
    assert images == {image}, images
    # after `envsubst '$REGISTRY'` it is a pullable reference: host/path:tag, lower case
    (pulled,) = {c["image"] for c in _containers(_manifest())}
    assert re.fullmatch(r"[a-z0-9.-]+\.[a-z]+(/[a-z0-9._-]+)+:[\w][\w.-]{0,127}", pulled), pulled
    docs = (ROOT / "docs" / "tpu.md").read_text()
    assert f"docker build -t {image} ." in docs and f"docker build -t {image} ." in (ROOT / "Dockerfile").read_text()
    assert "envsubst '$REGISTRY'" in docs  # only $REGISTRY: $KUBERAY_GEN_RAY_START_CMD must reach the pod
    workdir = next(x.split(None, 1)[1] for x in _dockerfile() if x.startswith("WORKDIR "))
    assert {c.get("workingDir") for c in _containers(doc)} == {workdir}  # where configs/ is


def test_custom_commands_are_kept_and_still_start_ray():
    """KubeRay replaces a container's command with its own unless the RayCluster carries the
    overwrite-container-cmd annotation; with it, the command must run KubeRay's `ray start` itself."""
    doc = _manifest()
    custom = [c for c in _containers(doc) if c.get("command") or c.get("args")]
    assert custom, "the manifest's containers run their own import check before ray start"
    assert doc["metadata"].get("annotations", {}).get(OVERWRITE) == "true"
    for c in custom:
        line = " ".join(c.get("command", []) + c.get("args", []))
        assert line.rstrip().endswith(GEN_CMD) and "--block" not in line, (c["name"], line)
        assert "pip install" not in line, "the image holds the code; nothing is installed at start"


@pytest.mark.parametrize("complete", [True, False])
def test_the_start_command_runs_ray_start_only_in_a_complete_image(tmp_path, complete):
    """Each container's command, run by bash as the pod would with a stand-in for KubeRay's
    `ray start`: it reaches it where rltpu, torch_tpu and libtpu are installed (this venv, with the tpu
    extra), and stops before it where they are not (the same Python without site-packages)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    py = bin_dir / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {'' if complete else '-S'} \"$@\"\n")
    py.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "KUBERAY_GEN_RAY_START_CMD": "echo RAY-STARTED",
           "HOME": str(tmp_path)}
    for c in _containers(_manifest()):
        res = subprocess.run(c["command"] + c["args"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
        assert ("RAY-STARTED" in res.stdout) is complete, (c["name"], res.stdout, res.stderr[-500:])
        assert (res.returncode == 0) is complete, (c["name"], res.returncode, res.stderr[-500:])


def test_dockerfile_installs_the_tpu_extra_on_the_pinned_ray_image():
    steps = _dockerfile()
    (base,) = [s.split()[1] for s in steps if s.startswith("FROM ")]
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)(-cpu)?", base)
    assert m, base  # {Ray version}-py{Python}[-cpu]: Ray's tag convention, no CUDA on a TPU host
    assert m.group(1) == _pin("ray") == _manifest()["spec"]["rayVersion"]
    least = tuple(int(x) for x in _pyproject()["project"]["requires-python"].lstrip(">=").split("."))
    assert (3, int(m.group(2))) >= least, (base, least)
    runs = [s for s in steps if s.startswith("RUN ")]
    torch = next(i for i, s in enumerate(runs) if f"torch=={_pin('torch')}" in s)
    assert "download.pytorch.org/whl/cpu" in runs[torch]
    project = next(i for i, s in enumerate(runs) if re.search(r"pip install .*'\.\[([\w,]+)\]'", s))
    extras = re.search(r"'\.\[([\w,]+)\]'", runs[project]).group(1).split(",")
    assert "tpu" in extras and torch < project, (extras, runs)
    assert set(extras) <= set(_pyproject()["project"]["optional-dependencies"])
    copy_step = next(i for i, s in enumerate(steps) if s.startswith("COPY "))
    workdir = next(x.split(None, 1)[1] for x in steps if x.startswith("WORKDIR "))
    assert re.fullmatch(rf"COPY (--chown=\S+ )?\. ({re.escape(workdir)}|\.)/?", steps[copy_step]), steps[copy_step]
    assert copy_step < steps.index(runs[project])
    assert "# libtpu for JAX samplers: see docs/tpu.md" in (ROOT / "Dockerfile").read_text()
    ignored = {x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines() if x.strip() and x[0] != "#"}
    assert {".venv", ".git", "runs"} <= ignored
    assert not ignored & {"rltpu", "actors", "learner", "configs", "pyproject.toml", "."}
