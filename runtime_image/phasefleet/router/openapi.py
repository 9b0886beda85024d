"""The router's /openapi.json: its own routes, with the request bodies a worker publishes.

The router passes generation and tokenizer bodies to a worker as received (the worker validates
them), so its routes read the raw request and FastAPI would document no body.
`publish_worker_bodies` adds the worker's: the same pydantic models through the same FastAPI
schema generation, so a client generator or a fuzzer sees one API whether it reads a worker or
the router. Nothing here runs on a request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI

from phasefleet.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
)
from phasefleet.server.tokenize import DetokenizeRequest, TokenizeRequest

REF_PREFIX = "#/components/schemas/"


def _worker_bodies() -> FastAPI:
    """Never served: the POST routes the router relays, with the worker's body parameters."""
    shape = FastAPI()

    @shape.post("/v1/completions")
    async def completions(req: CompletionRequest) -> None: ...

    @shape.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> None: ...

    @shape.post("/v1/responses")
    async def responses(req: ResponsesRequest) -> None: ...

    @shape.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> None: ...

    @shape.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> None: ...

    @shape.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> None: ...

    return shape


def _refs(node: Any) -> Iterator[str]:
    """The component names that `node` refers to directly or inside."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF_PREFIX):
            yield ref.removeprefix(REF_PREFIX)
        for child in node.values():
            yield from _refs(child)
    elif isinstance(node, list):
        for child in node:
            yield from _refs(child)


def publish_worker_bodies(app: FastAPI) -> None:
    """Makes the app's OpenAPI document declare the worker's request body on each route the
    router relays, with the component schemas those bodies refer to."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            worker = _worker_bodies().openapi()
            bodies = []
            for path, operations in worker["paths"].items():
                for method, operation in operations.items():
                    document["paths"][path][method]["requestBody"] = operation["requestBody"]
                    bodies.append(operation["requestBody"])
            schemas = worker["components"]["schemas"]
            needed, pending = set(), list(_refs(bodies))
            while pending:
                name = pending.pop()
                if name not in needed:
                    needed.add(name)
                    pending.extend(_refs(schemas[name]))
            mine = document.setdefault("components", {}).setdefault("schemas", {})
            mine.update({name: schemas[name] for name in sorted(needed)})
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
