"""API keys (server/auth.py): which paths need one, what a missing or wrong key gets, and that
a key is read from the environment as the operator writes it."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from phasefleet.api.contract import API_KEY_ENV
from phasefleet.server.auth import ApiKeyAuth, api_keys, bearer
from phasefleet.server.errors import install_error_handlers


def app(*keys: str) -> TestClient:
    served = FastAPI()
    install_error_handlers(served)
    for path in ("/v1/models", "/tokenize", "/health", "/metrics", "/internal/kv/1", "/version"):
        served.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
    served.add_middleware(ApiKeyAuth, keys=keys)
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
    assert api_keys({API_KEY_ENV: value}) == keys
    assert api_keys({}) == ()


def test_bearer_reads_only_a_bearer_token() -> None:
    assert bearer("Bearer abc") == "abc" and bearer("BEARER abc ") == "abc"
    assert bearer("Bearer") is None and bearer("Basic abc") is None and bearer(None) is None


def test_no_keys_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyAuth(FastAPI(), ())
