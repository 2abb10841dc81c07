"""OpenAI request and response schemas (and vLLM's extensions), as pydantic models.

Types are checked here; ranges are checked once, by engine.SamplingParams, so an error message
always names the same limits the engine enforces.

Request bodies are strict: a value of the wrong JSON type is a 400 `invalid_type` naming the
field, never converted ("5" is not a number, 1 is not a boolean, 1.0 is not a token id). The one
widening is JSON's own: an integer is a number, so `"temperature": 1` is 1.0. A null for a field
that has a default means what leaving the field out means."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler,
                      field_serializer, model_serializer, model_validator)

# ---- shared ------------------------------------------------------------------------------------


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do; known-unsupported ones are rejected.
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        """`"max_tokens": null` means the default (16 on completions), as leaving it out does,
        not "no value" (which ran to the end of the context). A required field stays required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_Body):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False
    """vLLM's: with include_usage, every chunk also carries the usage so far."""


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = 0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    priority: Optional[int] = None
    cache_salt: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    """vLLM's per-request KV tier filters and budgets (server/policy.py)."""
    # structured outputs (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* names; at most one of them per request
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    """Accepted and ignored: xgrammar is the one backend."""


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(_Body):
    type: str
    text: Optional[str] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments object as JSON text (OpenAI's shape: a string, not an object)."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    """An assistant turn's earlier tool calls."""
    tool_call_id: Optional[str] = None
    """A tool turn: which call this is the result of."""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """vLLM's: more variables for the chat template (Qwen3's `enable_thinking`, say)."""


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------


class _KVEcho(BaseModel):
    """A response with vLLM's kv_transfer_params field: left out of the JSON when None (a
    request that sent none gets none back, as from vLLM), not written as null."""

    @model_serializer(mode="wrap")
    def _echo_only_when_set(self, handler: SerializerFunctionWrapHandler):
        # No return annotation: the schema (OpenAPI's too) stays the model's own.
        data = handler(self)
        if isinstance(data, dict) and data.get("kv_transfer_params", ...) is None:
            del data["kv_transfer_params"]
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(_KVEcho):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    """vLLM's echo of the KV tier parameters applied, with tierserve's kv_policy and
    kv_hit_tokens (on a stream: in the chunk that finishes each choice); only for a request
    that sent kv_transfer_params, and left out, not null, otherwise (as vLLM does)."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(_KVEcho):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    """vLLM's echo of the KV tier parameters applied, with tierserve's kv_policy and
    kv_hit_tokens (on a stream: in the chunk that finishes each choice); only for a request
    that sent kv_transfer_params, and left out, not null, otherwise (as vLLM does)."""


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: the first has id, type and the whole name; the rest
    carry argument fragments the client appends, matched by index."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        """Unset delta fields are left out, as vLLM and OpenAI send them (no "role": null)."""
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(_KVEcho):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    """vLLM's echo of the KV tier parameters applied, with tierserve's kv_policy and
    kv_hit_tokens (on a stream: in the chunk that finishes each choice); only for a request
    that sent kv_transfer_params, and left out, not null, otherwise (as vLLM does)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
