"""runtime_image/Dockerfile, checked without a Docker engine: what it copies exists, it runs as a
numeric non-root user, and its ENTRYPOINT + CMD parse as a `phasefleet worker` command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dockerfile import instructions as dockerfile_instructions

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "runtime_image" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE)


def last(keyword: str) -> str:
    values = [rest for kw, rest in instructions() if kw == keyword]
    assert values, f"the Dockerfile has no {keyword}"
    return values[-1]


def exec_form(keyword: str) -> list[str]:
    value = json.loads(last(keyword))
    assert isinstance(value, list)
    assert all(isinstance(part, str) for part in value)
    return value


def test_base_is_a_cuda_torch_image_pinned_to_our_torch() -> None:
    pinned = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned is not None
    base = next(rest for kw, rest in instructions() if kw == "ARG" and "BASE_IMAGE=" in rest)
    image = base.split("=", 1)[1]
    assert image.startswith(f"pytorch/pytorch:{pinned.group(1)}-cuda")
    assert last("FROM") == "${BASE_IMAGE}"


def test_every_copy_source_exists() -> None:
    copies = [rest for kw, rest in instructions() if kw == "COPY"]
    assert copies
    for rest in copies:
        parts = [p for p in rest.split() if not p.startswith("--")]
        *sources, _destination = parts
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"


def test_installs_the_package_with_its_engine_extra() -> None:
    runs = " ".join(rest for kw, rest in instructions() if kw == "RUN")
    assert 'pip install ".[engine]"' in runs
    # setup.py maps the namespace package over both roots: both must be in the image.
    copied = " ".join(rest for kw, rest in instructions() if kw == "COPY")
    for needed in ("pyproject.toml", "setup.py", "README.md", "operator/", "runtime_image/"):
        assert needed in copied


def test_runs_as_a_numeric_non_root_user() -> None:
    user = last("USER")
    uid = user.split(":")[0]
    assert uid.isdigit(), f"USER should be numeric for runAsNonRoot, got {user}"
    assert int(uid) != 0


def test_entrypoint_and_cmd_parse_as_a_worker_command_line() -> None:
    from phasefleet.cli import build_parser
    from phasefleet.server import cli as worker_cli

    entrypoint, cmd = exec_form("ENTRYPOINT"), exec_form("CMD")
    assert entrypoint == ["phasefleet", "worker"]
    args = build_parser().parse_args([*entrypoint[1:], *cmd])
    assert args.command == "worker"
    assert args.run is worker_cli.run
    assert args.model == "/models/model"
    assert last("EXPOSE") == str(args.port)
    healthcheck = last("HEALTHCHECK")
    assert f"127.0.0.1:{args.port}/health" in healthcheck


@pytest.mark.parametrize("extra", [["--role", "decode", "--dtype", "bfloat16"]])
def test_entrypoint_parses_without_the_operator_extras(extra: list[str]) -> None:
    # The image installs only the `engine` extra: the console script must not need kopf or
    # kubernetes to parse a worker command line.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('kopf', 'kubernetes', 'prometheus_api_client'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from phasefleet.cli import build_parser\n"
        "args = build_parser().parse_args(sys.argv[1:])\n"
        "print(args.command, args.role, args.dtype)\n"
    )
    argv = [*exec_form("ENTRYPOINT")[1:], *exec_form("CMD"), *extra]
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["worker", "decode", "bfloat16"]
