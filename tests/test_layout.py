"""The repository's shape: one namespace package over two roots, no shadowing `operator`,
and a test runner wrapper that never mistakes "no tests" for success."""

from __future__ import annotations

import ast
import importlib
import operator
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_phasefleet_is_a_namespace_package_over_both_roots() -> None:
    import phasefleet

    assert getattr(phasefleet, "__file__", None) is None  # a namespace package: no __init__
    assert not (REPO / "operator/phasefleet/__init__.py").exists()
    assert not (REPO / "runtime_image/phasefleet/__init__.py").exists()
    roots = {
        "api": "operator",
        "operator": "operator",
        "autoscale": "operator",
        "engine": "runtime_image",
        "server": "runtime_image",
        "router": "runtime_image",
        "local": "runtime_image",
    }
    for name, root in roots.items():
        module = importlib.import_module(f"phasefleet.{name}")
        assert module.__doc__
        assert Path(str(module.__file__)).resolve().parent == REPO / root / "phasefleet" / name


def imports(path: Path) -> set[str]:
    """The modules a file imports (absolute imports, as every module here writes them)."""
    tree = ast.parse(path.read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return found | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_packages_import_one_way() -> None:
    """The policy and its sources know no Kubernetes objects: operator/ imports autoscale/,
    never the reverse; and no e2e test module imports another (shared code is harness)."""
    for path in (REPO / "operator/phasefleet/autoscale").glob("*.py"):
        wrong = {m for m in imports(path) if m.startswith("phasefleet.operator")}
        assert not wrong, f"{path.name} imports {wrong}"
    for path in [*(REPO / "e2e").glob("*.py"), *(REPO / "bench").glob("*.py")]:
        wrong = {m for m in imports(path) if m.startswith("e2e.test_")}
        assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


def test_operator_is_still_the_standard_library_module() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(operator.__file__).resolve().parent == stdlib
    probe = "import operator, sys; print(operator.__file__)"
    for cwd in (REPO, REPO / "operator"):
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True
        )
        assert Path(out.stdout.strip()).resolve().parent == stdlib
    assert not (REPO / "operator/__init__.py").exists()
    assert not (REPO / "operator.py").exists()


def test_extras_pin_the_versions_that_matter() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {
        req.split("==")[0]: req.split("==")[1]
        for reqs in [project["dependencies"], *project["optional-dependencies"].values()]
        for req in reqs
        if "==" in req
    }
    for name in ("torch", "transformers", "kopf", "kubernetes", "pydantic", "fastapi"):
        assert name in pins, f"{name} is not pinned"
    assert "prometheus-api-client" in pins
    assert set(project["optional-dependencies"]) >= {"engine", "operator", "dev"}
    assert project["scripts"]["phasefleet"] == "phasefleet.cli:main"


def run_strict_pytest(directory: Path) -> subprocess.CompletedProcess[str]:
    wrapper = str(REPO / "scripts/pytest-strict")
    argv = [wrapper, sys.executable, str(directory), "-q", "-p", "no:cacheprovider"]
    return subprocess.run(argv, capture_output=True, text=True)


def test_pytest_wrapper_fails_when_no_tests_are_collected(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("# no tests here\n")
    run = run_strict_pytest(tmp_path)
    assert run.returncode == 1
    assert "collected no tests" in run.stderr


def test_pytest_wrapper_passes_through_results(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_ok():\n    assert True\n")
    assert run_strict_pytest(tmp_path).returncode == 0
    (tmp_path / "test_one.py").write_text("def test_bad():\n    assert False\n")
    assert run_strict_pytest(tmp_path).returncode == 1


def test_ci_runs_make_test() -> None:
    ci = (REPO / ".ci/run").read_text()
    assert "make test" in ci
    makefile = (REPO / "Makefile").read_text()
    test_line = next(line for line in makefile.splitlines() if line.startswith("test:"))
    assert test_line.split(":", 1)[1].split() == ["lint", "test-unit", "test-e2e"]
