"""API keys (server/auth.py, server/api_keys.py): which paths need one, what a missing or wrong
key gets, and that keys are read from the environment and from a file that may change (a
mounted Secret the kubelet updates)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from phasefleet.api.contract import API_KEY_ENV, API_KEY_FILE_ENV
from phasefleet.server.api_keys import ApiKeys
from phasefleet.server.auth import ApiKeyAuth, bearer
from phasefleet.server.errors import install_error_handlers


def app(*keys: str, source: ApiKeys | None = None) -> TestClient:
    served = FastAPI()
    install_error_handlers(served)
    for path in ("/v1/models", "/tokenize", "/health", "/metrics", "/internal/kv/1", "/version"):
        served.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
    served.add_middleware(ApiKeyAuth, keys=source or ApiKeys(keys))
    return TestClient(served)


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize", "/nowhere"])
def test_the_api_needs_a_key_in_openais_shape(path: str) -> None:
    client = app("k1")
    missing = client.get(path)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    error = missing.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "Authorization: Bearer" in error["message"]
    wrong = client.get(path, headers={"Authorization": "Bearer k2"})
    assert wrong.status_code == 401 and "k2" not in wrong.text  # never echoed
    assert wrong.json()["error"]["message"] == "incorrect API key provided"
    assert client.get(path, headers={"Authorization": "Basic k1"}).status_code == 401


def test_any_of_the_keys_opens_it() -> None:
    client = app("old", "new")
    for key in ("old", "new"):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert client.get("/v1/models", headers={"authorization": "bearer  new "}).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/internal/kv/1"])
def test_probes_metrics_and_the_hand_off_stay_open(path: str) -> None:
    assert app("k1").get(path).status_code == 200


@pytest.mark.parametrize(
    ("value", "keys"),
    [("k1", ("k1",)), (" new , old ", ("new", "old")), ("", ()), (" , ", ())],
)
def test_keys_come_from_the_environment(value: str, keys: tuple[str, ...]) -> None:
    assert ApiKeys.from_env({API_KEY_ENV: value}).current() == keys
    assert ApiKeys.from_env({}).current() == () and not ApiKeys.from_env({})


def test_a_changed_key_file_takes_effect_without_a_restart(tmp_path: Path) -> None:
    """Rotation as a mounted Secret does it: the file's new keys are taken at the next look
    (at most once a second); a file that goes missing or empty meanwhile keeps the last keys;
    one unreadable at start is refused."""
    now = [0.0]
    keys_file = tmp_path / "keys"
    keys_file.write_text("old\n")
    source = ApiKeys(("fixed",), keys_file, clock=lambda: now[0])
    client = app(source=source)

    def status(key: str) -> int:
        return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

    assert (status("old"), status("fixed"), status("new")) == (200, 200, 401)
    keys_file.write_text("old,new\n")  # the new key added beside the old one
    assert status("new") == 401  # not looked at again within the second
    now[0] += 1.0
    assert (status("new"), status("old")) == (200, 200)
    keys_file.write_text("new")  # the old key dropped
    now[0] += 1.0
    assert (status("old"), status("new")) == (401, 200)
    keys_file.unlink()  # mid-swap: the last keys stay
    now[0] += 1.0
    assert status("new") == 200
    keys_file.write_text("  \n")
    now[0] += 1.0
    assert status("new") == 200
    env = {API_KEY_FILE_ENV: str(tmp_path / "missing")}
    with pytest.raises(ValueError, match="cannot be read or holds no key"):
        ApiKeys.from_env(env)


def test_bearer_reads_only_a_bearer_token() -> None:
    assert bearer("Bearer abc") == "abc" and bearer("BEARER abc ") == "abc"
    assert bearer("Bearer") is None and bearer("Basic abc") is None and bearer(None) is None


def test_no_keys_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyAuth(FastAPI(), ApiKeys())
