"""operator/Dockerfile, checked without a Docker engine: sources, user, entrypoint, extras."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from phasefleet.cli import build_parser
from tests.dockerfile import instructions as dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "operator" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE)


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def test_copy_sources_exist():
    copies = [rest for word, rest in instructions() if word == "COPY" and "--from" not in rest]
    assert copies
    for rest in copies:
        *sources, _dest = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_dockerignore_keeps_the_copied_sources():
    ignored = [
        line.strip()
        for line in DOCKERFILE.with_name("Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in ignored and ".git" in ignored
    copies = [rest for word, rest in instructions() if word == "COPY" and "--from" not in rest]
    for rest in copies:
        *sources, _dest = shlex.split(rest)
        for source in sources:
            top = source.strip("/").split("/")[0]
            assert top not in ignored, f"COPY {source} is excluded by the .dockerignore"


def test_runs_as_a_numeric_non_root_user():
    users = [rest for word, rest in final_stage() if word == "USER"]
    assert users, "no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_entrypoint_is_phasefleet_operator_and_parses():
    (entrypoint,) = [rest for word, rest in final_stage() if word == "ENTRYPOINT"]
    argv = json.loads(entrypoint)
    assert argv[:2] == ["phasefleet", "operator"]
    args = build_parser().parse_args(argv[1:] + ["--log-level=info"])
    assert args.run.__module__ == "phasefleet.operator.cli"


def test_installs_only_the_operator_extra_and_no_torch():
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert '".[operator]"' in runs
    assert "torch" not in runs.replace('import torch"', "")
    base = [rest for word, rest in instructions() if word == "FROM"]
    assert all("slim" in b for b in base)


def test_chart_runs_the_image_as_the_same_user():
    template = (ROOT / "helm/phasefleet/templates/deployment.yaml").read_text()
    uid = next(rest for word, rest in final_stage() if word == "USER").split(":")[0]
    assert f"runAsUser: {uid}" in template
    values = yaml.safe_load((ROOT / "helm/phasefleet/values.yaml").read_text())
    assert values["image"]["repository"].endswith("phasefleet-operator")
