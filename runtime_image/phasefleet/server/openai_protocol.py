"""Pydantic models of the OpenAI requests and responses the worker speaks.

Requests carry vLLM-style extensions (`top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`return_token_ids`, `chat_template_kwargs`). Range checks live in the field constraints so that
a bad value becomes a 400 naming the field; the sampling bounds are the engine's own
(`phasefleet.engine.sampling_params`, torch-free). Fields OpenAI has and we do not implement are
accepted only at their neutral value (see `unsupported`); unknown fields are ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from phasefleet.engine.sampling_params import (
    API_SEED_MAX,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_TOP_K,
    SEED_MIN,
)
from phasefleet.server.errors import bad_request
from phasefleet.server.logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs

TokenIds = list[Annotated[int, Field(ge=0)]]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
OptionalIds = list[int] | None

# apply_chat_template's own parameters (and the messages): `chat_template_kwargs` may not set them
TEMPLATE_PARAMETERS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("0 would keep no prompt token: give -1 (the model's length) or k >= 1")
    return value


# vLLM's `priority` (lower first), within a 32-bit integer
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
# vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: the model's length)
TruncatePromptTokens = Annotated[int, Field(ge=-1), AfterValidator(_not_zero)]


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(kwargs or {}) & TEMPLATE_PARAMETERS)
    if taken:
        raise ValueError(
            f"may not set {', '.join(taken)}: these are the request's own fields or the"
            " template's inputs; give only the template's variables (e.g. enable_thinking)"
        )
    return kwargs


# vLLM's `chat_template_kwargs`: extra variables for the chat template (Qwen3's enable_thinking)
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_variables)]


def _ids_field() -> Any:
    """Token ids in a response: present only when the request asked (`return_token_ids`)."""
    return Field(default=None, exclude_if=lambda v: v is None)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's: free text, any JSON object, or JSON that a schema accepts."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, any JSON object, a regex, a choice or
    a grammar."""

    model_config = ConfigDict(extra="allow")

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a context-free grammar, in Lark's or GBNF's syntax


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=MIN_TOP_K)
    seed: int | None = Field(None, ge=SEED_MIN, le=API_SEED_MAX)
    stop: StopString | StopStrings | None = None
    stop_token_ids: TokenIds | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)  # vLLM's
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's: the stop string found ends the text
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens in the text
    priority: Priority = 0  # vLLM's: lower is served first (--scheduling-policy priority)
    # vLLM's: only the prompt's last k tokens are used (-1: the model's maximum length)
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # vLLM's: each prompt token's logprob, rank and the k most likely in its place (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # token id (as a string, as OpenAI's) -> bias
    logit_bias: (
        dict[
            Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
            Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
        ]
        | None
    ) = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    # vLLM's: only these tokens may be sampled; these words never appear (server/token_rules.py)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    bad_words: list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]] | None = None
    user: str | None = None
    # structured output (server/structured.py): OpenAI's field, vLLM's, and vLLM's older ones
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # vLLM's sampling extensions this worker does not implement, accepted at their neutral
    # value only: refused otherwise, never ignored (the answer would not be what was asked)
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logits_processors: list[Any] | None = None

    def unsupported(self) -> list[str]:
        """Names of set fields this worker does not implement."""
        neutral = {
            "spaces_between_special_tokens": True, "use_beam_search": False,
            "length_penalty": 1.0, "logits_processors": None,
        }  # fmt: skip
        return [name for name, value in neutral.items() if getattr(self, name) not in (value, [])]

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of not in (None, self.n):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # server/tools.py
    parallel_tool_calls: bool = True  # false: one call at most (server/tools.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued
    chat_template_kwargs: TemplateKwargs = None
    chat_template: str | None = None  # vLLM's: a template of the request's own (refused)
    echo: bool = False  # vLLM's: the last message before the answer (refused)

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        return bad + [name for name in ("chat_template", "echo") if getattr(self, name)]

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: OptionalIds = _ids_field()
    token_ids: OptionalIds = _ids_field()
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # the thought of a reasoning model (--reasoning-parser), as DeepSeek's and vLLM's APIs name it
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: OptionalIds = _ids_field()
    token_ids: OptionalIds = _ids_field()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str = ""


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)  # in a call's first
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: OptionalIds = _ids_field()
    token_ids: OptionalIds = _ids_field()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int  # the worker's start, in Unix seconds: the same in every answer
    owned_by: str = "phasefleet"
    root: str  # the served name too: a model's folder is the host's business
    parent: str | None = None  # a LoRA adapter's base model (its served name)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Runtime LoRA adapters (vLLM's bodies): the worker's endpoints and the router's, which sends them
# to every worker. Error codes the router reads in the workers' answers:
LORA_ALREADY_LOADED = "lora_already_loaded"  # 400 from load: counts as loaded
LORA_NOT_FOUND = "not_found"  # 404 from unload: counts as unloaded
LORA_IN_USE = "lora_in_use"  # 409 from unload: requests still use it


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=100)
    lora_path: str = Field(min_length=1, max_length=4096)  # a folder, or a repo id org/name


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=100)


# OpenAI's Responses API, for text (server/responses_api.py)
class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallInput(BaseModel):
    """A call the model made earlier, sent back as part of the conversation."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(BaseModel):
    """What a call returned: the tool's message."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningInput(BaseModel):
    """An earlier reasoning item sent back: not shown to the model again (as chat templates
    drop earlier turns' thoughts)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallInput | FunctionCallOutput | ReasoningInput


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True  # accepted; nothing is stored
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: one call at most, as chat's
    priority: Priority = 0  # vLLM's, as chat's
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this is underneath (a 400 for what this endpoint does not serve)."""
        if self.previous_response_id is not None:
            raise bad_request(
                "responses are not stored here: send the whole conversation as input",
                "previous_response_id",
            )
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += _chat_messages(self.input)
        if not messages:
            raise bad_request(
                "input must hold a message or a function call (reasoning items are left out)",
                "input",
            )
        try:
            return self._chat(messages)
        except ValidationError as exc:  # what chat refuses of it: named as this request has it
            error = exc.errors()[0]
            where = [str(p) for p in error["loc"] if p != "function"]  # a tool's own fields
            field = ".".join(["input" if p == "messages" else p for p in where])
            raise bad_request(f"{field}: {error['msg']}", field) from None

    def _chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {
                "model": self.model,
                "messages": messages,
                "tools": self.chat_tools(),
                "tool_choice": self.chat_tool_choice(),
                "parallel_tool_calls": self.parallel_tool_calls,
                "priority": self.priority,
                "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "stream": self.stream,
                "response_format": self.response_format(),
            }
        )

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's shape (the Responses API holds a function's fields in
        the tool itself); OpenAI's hosted tools (web search, files, ...) are a 400."""
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise bad_request(
                    f"only function tools are served, got {tool.get('type')!r}",
                    f"tools[{i}].type",
                )
            keys = ("name", "description", "parameters", "strict")
            tools.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and "name" in choice:
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request(
            'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
            "tool_choice",
        )

    def text_format(self) -> dict[str, Any]:
        return dict((self.text or {}).get("format") or {"type": "text"})

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format: free text (None), any JSON object, or JSON
        a schema accepts (the Responses API holds the schema's fields in the format itself)."""
        fmt = self.text_format()
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            keys = ("name", "description", "schema", "strict")
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
        raise bad_request(
            f"text.format.type must be text, json_object or json_schema, got {kind!r}",
            "text.format.type",
        )


def _chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: a run of function calls becomes one assistant message with
    those tool_calls, each output a tool message; reasoning items are left out."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallInput):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | TokenIds | list[str] | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # the first this many, normalized again
    user: str | None = None
    # vLLM's: keep each input's last k tokens (-1: the model's length)
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    normalize: bool | None = None  # vLLM's: None: as the model says (server/pooling.py)
    priority: Priority = 0  # vLLM's, as generation's


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with "base64"
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
