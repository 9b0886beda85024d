"""POST /tokenize and POST /detokenize in vLLM's shapes, and GET /version.

/tokenize takes a `prompt` (with `add_special_tokens`, default true) or chat `messages` (rendered
with the chat template, `add_generation_prompt` default true, `add_special_tokens` default false)
and answers `{count, max_model_len, tokens}`; /detokenize takes `tokens` and answers `{prompt}`.
Both run on the tokenizer thread; like generation, they answer 503 while the model loads.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from phasefleet.server.errors import bad_request, unavailable
from phasefleet.server.openai_protocol import ChatMessage, TemplateKwargs

if TYPE_CHECKING:  # the router imports package_version: no engine-side imports at run time
    from phasefleet.server.state import WorkerState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def package_version() -> str:
    try:
        return version("phasefleet")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def tokenize(body: TokenizeRequest, state: WorkerState) -> list[int]:
    """The token ids (tokenizer thread)."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(state.tokenizer.encode(body.prompt, add_special_tokens=special))
    messages = [{"role": m.role, "content": m.text()} for m in body.messages or []]
    try:
        text = state.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises whatever the template author chose
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    special = bool(body.add_special_tokens)
    return list(state.tokenizer.encode(str(text), add_special_tokens=special))


def detokenize(body: DetokenizeRequest, state: WorkerState) -> str:
    """The text of the tokens (tokenizer thread)."""
    bad = [t for t in body.tokens if t >= state.vocab_size]
    if bad:
        raise bad_request(
            f"tokens holds token id {bad[0]}, outside the vocabulary [0, {state.vocab_size})",
            "tokens",
        )
    return str(state.tokenizer.decode(body.tokens))


def check(model: str | None, state: WorkerState) -> None:
    """404 for another model's name (none given is fine, as in vLLM); 503 while loading."""
    if model is not None:
        state.check_model(model)
    if not state.engine.ready:
        raise unavailable("the model is still loading", "not_ready")


def tokenizer_routes(state: WorkerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        check(body.model, state)
        tokens = await state.off_loop(tokenize, body, state)
        max_len = state.engine.max_model_len
        return TokenizeResponse(count=len(tokens), max_model_len=max_len, tokens=tokens)

    @routes.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        check(body.model, state)
        return DetokenizeResponse(prompt=await state.off_loop(detokenize, body, state))

    @routes.get("/version")
    async def version_route() -> VersionResponse:
        return VersionResponse(version=package_version())

    return routes
