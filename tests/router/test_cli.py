"""`phasefleet router` accepts exactly what the operator passes, and refuses bad layouts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phasefleet.cli import build_parser
from phasefleet.router.cli import discoveries, run
from phasefleet.router.discovery import DnsDiscovery, StaticDiscovery
from phasefleet.router.policy import POLICIES


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_the_operators_router_args_parse(
    mode: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # outside a pod: DNS
    from phasefleet.api.spec import parse_spec
    from phasefleet.operator.meta import Owner
    from phasefleet.operator.workloads import router_args

    pools: dict[str, object] = (
        {"worker": {"replicas": 2}}
        if mode == "aggregated"
        else {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    )
    spec = parse_spec(
        {"model": {"image": {"path": "/models/tiny"}}, "mode": mode, "router": {"policy": policy},
         **pools}
    )  # fmt: skip
    owner = Owner(name="llm", namespace="team-a", uid="uid-llm")
    args = build_parser().parse_args(router_args(owner, spec))
    assert args.command == "router"
    assert args.policy == policy
    assert args.port == 8000
    assert args.host == "0.0.0.0"
    sources = discoveries(args)
    expected = ["worker"] if mode == "aggregated" else ["prefill", "decode"]
    assert list(sources) == expected
    for name, source in sources.items():
        assert isinstance(source, DnsDiscovery)
        assert source.describe() == f"llm-{name}.team-a.svc:8000"


def test_a_static_list_for_local_use() -> None:
    args = build_parser().parse_args(
        ["router", "--served-model-name", "m", "--workers", "127.0.0.1:8001, http://h:8002/"]
    )
    source = discoveries(args)["worker"]
    assert isinstance(source, StaticDiscovery)
    assert source.urls == ["http://127.0.0.1:8001", "http://h:8002"]


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--workers", "h:1", "--worker-service", "s:1"],
        ["--prefill-service", "p:1"],
        ["--worker-service", "s:1", "--decode-service", "d:1"],
        ["--worker-service", "no-port"],
        ["--workers", "h:1", "--max-attempts", "0"],
        ["--workers", "ftp://h:1"],
        ["--workers", "h:1", "--late-after-ms", "0"],
    ],
)
def test_bad_settings_exit_2_with_a_message(
    flags: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(log))
    args = build_parser().parse_args(["router", "--served-model-name", "m", *flags])
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("phasefleet router: ")
    assert log.read_text() == err.removeprefix("phasefleet router: ")  # one line, for the pod


def test_unknown_policy_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--served-model-name", "m", "--policy", "random"])


def test_the_cli_needs_no_server_dependencies() -> None:
    """The operator image has no fastapi, uvicorn or torch; `phasefleet` must still parse."""
    probe = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client', 'torch'):\n"
        "    sys.modules[name] = None\n"
        "from phasefleet.cli import build_parser\n"
        "args = build_parser().parse_args(['router', '--served-model-name', 'm',\n"
        "                                  '--worker-service', 'w.ns.svc:8000'])\n"
        "print(args.command, args.policy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["router", "least-loaded"]


def test_a_port_it_cannot_listen_on_is_the_termination_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(log))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(
            ["router", "--served-model-name", "m", "--workers", "http://127.0.0.1:9",
             "--host", "127.0.0.1", "--port", str(port)]
        )  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            run(args)
    code = exited.value.code
    assert code not in (0, None)
    expected = f"could not serve on 127.0.0.1:{port} (uvicorn exited {code})"
    assert log.read_text().startswith(expected)
