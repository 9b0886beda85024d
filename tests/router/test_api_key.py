"""API keys over real processes: a disaggregated fleet whose router and workers all hold keys
answers only clients that send one, passes the client's key on to the workers, and still hands
the KV off between them (the hand-off has its own token)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.api.contract import API_KEY_ENV, INTERNAL_TOKEN_ENV
from tests.router.router_proc import run_router
from tests.server.worker_proc import Served, run_worker

KEYS = "new-key,old-key"  # two keys, as while one replaces the other
ARGS = ("--num-kv-blocks", "64", "--block-size", "16")
PROMPT = "The tide comes in and goes out again, " * 4


def ask(served: Served, key: str | None) -> str:
    """A completion through the official client; `key` None sends no Authorization at all."""
    client = openai.OpenAI(
        base_url=f"{served.base_url}/v1", api_key=key or "unused", max_retries=0, timeout=60
    )
    omit = {"Authorization": openai.Omit()} if key is None else None
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_headers=omit
    )
    return out.choices[0].text


def test_a_fleet_with_keys_answers_only_clients_that_send_one(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "internal")
    monkeypatch.setenv(API_KEY_ENV, KEYS)
    members = tmp_path / "workers.json"
    with (
        run_worker(tiny_model, "--role", "prefill", *ARGS) as prefill,
        run_worker(
            tiny_model, "--role", "decode", "--remote-prefill-min-tokens", "0", *ARGS
        ) as decode,
    ):
        members.write_text(json.dumps({"prefill": [prefill.base_url], "decode": [decode.base_url]}))
        with run_router("--workers-file", str(members), "--refresh-interval", "0.5") as router:
            remote = decode.counter("phasefleet_prefills_total", where="remote")
            for key in ("new-key", "old-key"):
                assert ask(router, key)
            assert decode.counter("phasefleet_prefills_total", where="remote") == remote + 2

            for served in (router, decode):
                with pytest.raises(openai.AuthenticationError, match="missing API key"):
                    ask(served, None)
                with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
                    ask(served, "guess")
            headers = {"Authorization": "Bearer old-key"}
            models = httpx.get(f"{router.base_url}/v1/models", headers=headers, timeout=10)
            assert [m["id"] for m in models.json()["data"]] == ["tiny"]  # asked a worker
            tokens = httpx.post(
                f"{router.base_url}/tokenize", json={"prompt": "hi"}, headers=headers, timeout=10
            )
            assert tokens.status_code == 200 and tokens.json()["tokens"]
            assert httpx.get(f"{router.base_url}/v1/models", timeout=10).status_code == 401
            for served in (router, prefill, decode):  # probes and scrapes need no key
                assert httpx.get(f"{served.base_url}/health", timeout=10).status_code == 200
                assert httpx.get(f"{served.base_url}/metrics", timeout=10).status_code == 200
