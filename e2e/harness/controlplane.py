"""A real Kubernetes control plane as local processes: etcd, kube-apiserver (secure port on
127.0.0.1, static token auth, RBAC, service-account keys), kube-controller-manager,
kube-scheduler, and KWOK managing fake nodes. Everything lives in one work directory."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.harness.memcg import remove_cgroup, stray_cgroups
from e2e.harness.nodes import FAKE_NODES, node_manifests
from e2e.harness.pki import Pki, make_pki
from e2e.harness.podnet import claim_block, ensure_local_route, release_block
from e2e.harness.podrunner import stray_process_groups
from e2e.harness.process import Component, free_port, process_group_alive, stop_process_group

REPO = Path(__file__).resolve().parents[2]

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service's ClusterIP: first address of SERVICE_CIDR
# KWOK's only pod stage: a bound pod gets its IPs and waits for its containers. The pod runner,
# not KWOK, then makes it Ready (or not) and deletes it once its containers are stopped; KWOK's
# default stages would mark every pod Ready at once and delete it without its grace period.
KWOK_POD_STAGES = Path(__file__).with_name("kwok-pod-stages.yaml")


def tools_bin_dir() -> Path:
    """The cached tool directory (built by e2e/tools/install.sh)."""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["bash", str(repo / "e2e/tools/install.sh"), "--print"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


@dataclass
class ControlPlane:
    workdir: Path
    bin_dir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    apiserver_port: int = 0
    pod_cidr: str = ""  # KWOK hands pod IPs from here (podnet.py: local, not loopback)
    components: list[Component] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def image_root(self) -> Path:
        """The files of "the image" pods run from: container path /x is image_root/x."""
        return self.workdir / "image"

    @property
    def pods_dir(self) -> Path:
        """A folder per pod the runner runs: volumes, one log and pid file per container."""
        return self.workdir / "pods"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["HELM_CACHE_HOME"] = str(self.workdir / "helm/cache")
        env["HELM_CONFIG_HOME"] = str(self.workdir / "helm/config")
        env["HELM_DATA_HOME"] = str(self.workdir / "helm/data")
        return env

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Starts every component and returns once the API server is ready, the controllers
        run (the default ServiceAccount exists) and the fake nodes are Ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = make_pki(self.workdir / "pki", SERVICE_IP)
        self.apiserver_port = free_port()
        (self.workdir / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        self._write_kubeconfig(pki)
        ensure_local_route()  # if it cannot, the runner says so on each pod it cannot run
        block = claim_block(self.workdir)
        self.pod_cidr = f"{block.network_address + 1}/{block.prefixlen}"
        deadline = time.monotonic() + timeout
        try:
            etcd_url = self._start_etcd()
            self._wait_http(f"{etcd_url}/health", deadline, component="etcd", tls=False)
            self._start("kube-apiserver", self._apiserver_args(pki, etcd_url))
            self._wait_http(f"{self.server}/readyz", deadline, component="kube-apiserver")
            self._start("kube-controller-manager", self._controller_manager_args(pki))
            self._start("kube-scheduler", self._scheduler_args())
            self._start("kwok", self._kwok_args(), env={**os.environ, "HOME": str(self.workdir)})
            self.kubectl("apply", "-f", "-", input=node_manifests())
            self._wait_until(self._controllers_running, deadline, "controller-manager")
            self._wait_until(self._nodes_ready, deadline, "KWOK nodes Ready")
            self._start_pod_runner()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        # Containers of a runner that died without stopping them.
        for group in stray_process_groups(self.pods_dir):
            if process_group_alive(group):
                stop_process_group(group, grace_seconds=5)
        for cgroup in stray_cgroups(self.pods_dir):
            remove_cgroup(cgroup)

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        """What a run pod's container printed (all its restarts)."""
        for folder in self.pods_dir.glob(f"{namespace}_{pod}_*"):
            path = folder / f"{container}.log"
            if path.exists():
                return path.read_text(errors="replace")
        return "(no log)"

    def destroy(self) -> None:
        """Stops everything and removes the work directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        release_block(self.workdir)

    def pids(self) -> list[int]:
        return [c.pid for c in self.components if c.pid is not None]

    def log_tails(self, lines: int = 40) -> dict[str, str]:
        return {c.name: c.log_tail(lines) for c in self.components}

    # -- clients ---------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run(["kubectl", *args], input=input, check=check, timeout=timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return self._run(["helm", *args], input=input, check=check, timeout=timeout)

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def api_client(self) -> Any:
        from kubernetes import client, config

        api_config = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=api_config)
        return client.ApiClient(api_config)

    def _run(
        self, argv: list[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / argv[0]), *argv[1:]]
        result = subprocess.run(
            argv, input=input, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:4])} ... failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    # -- components ------------------------------------------------------------------------

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        component = Component(
            name=name,
            argv=[str(self.bin_dir / name), *args],
            log_path=self.logs_dir / f"{name}.log",
            env=env,
        )
        component.start()
        self.components.append(component)

    def _start_pod_runner(self) -> None:
        self.image_root.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "e2e.harness.podrunner",
            f"--kubeconfig={self.kubeconfig}",
            f"--workdir={self.pods_dir}",
            f"--image-root={self.image_root}",
        ]  # fmt: skip
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        component = Component("pod-runner", argv, self.logs_dir / "pod-runner.log", env=env)
        component.start()
        self.components.append(component)

    def _start_etcd(self) -> str:
        client_port, peer_port = free_port(), free_port()
        client_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._start(
            "etcd",
            [
                "--name=e2e",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=e2e={peer_url}",
                "--unsafe-no-fsync",  # test data only: no fsync keeps start and writes fast
                "--log-level=warn",
            ],
        )
        return client_url

    def _apiserver_args(self, pki: Pki, etcd_url: str) -> list[str]:
        return [
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=false",
            # The default endpoint reconciler rejects a loopback advertise address.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ]

    def _controller_manager_args(self, pki: Pki) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.ca_key}",
            "--profiling=false",
            "--v=1",
        ]

    def _scheduler_args(self) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--authentication-skip-lookup=true",  # no front proxy: no request-header CA to find
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]

    def _kwok_args(self) -> list[str]:
        return [
            f"--config={KWOK_POD_STAGES}",
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={self.pod_cidr}",
            "--node-ip=10.240.0.1",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{free_port()}",
        ]

    def _write_kubeconfig(self, pki: Pki) -> None:
        import base64

        ca_data = base64.b64encode(pki.ca_cert.read_bytes()).decode()
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "phasefleet-e2e",
                    "cluster": {"server": self.server, "certificate-authority-data": ca_data},
                }
            ],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "phasefleet-e2e",
                    "context": {"cluster": "phasefleet-e2e", "user": "admin"},
                }
            ],
            "current-context": "phasefleet-e2e",
        }
        self.kubeconfig.write_text(json.dumps(kubeconfig, indent=2))
        self.kubeconfig.chmod(0o600)

    # -- readiness -------------------------------------------------------------------------

    def _wait_http(self, url: str, deadline: float, component: str, tls: bool = True) -> None:
        context = None
        headers = {}
        if tls:
            context = ssl.create_default_context(cafile=str(self.workdir / "pki/ca.crt"))
            headers["Authorization"] = f"Bearer {self.token}"
        last_error = ""
        while time.monotonic() < deadline:
            for c in self.components:
                c.check_alive()
            try:
                request = urllib.request.Request(url, headers=headers)
                with urllib.request.urlopen(request, context=context, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last_error = str(exc)
            time.sleep(0.25)
        raise TimeoutError(f"{component} not ready at {url}: {last_error}")

    def _wait_until(self, ready: Any, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            for c in self.components:
                c.check_alive()
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what}")

    def _controllers_running(self) -> bool:
        # The service-account controller makes `default` in every namespace once it runs.
        result = self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False)
        return result.returncode == 0

    def _nodes_ready(self) -> bool:
        nodes = self.get_json("nodes")["items"]
        ready = {
            n["metadata"]["name"]
            for n in nodes
            for cond in n.get("status", {}).get("conditions", [])
            if cond["type"] == "Ready" and cond["status"] == "True"
        }
        return {node.name for node in FAKE_NODES} <= ready
