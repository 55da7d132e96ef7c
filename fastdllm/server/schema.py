"""Request bodies (pydantic, strict, unknown fields refused) and OpenAI-shaped errors.

The dLLM fields of a request are generated from `GenerationConfig`'s declarations.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ..config import MAX_LOGPROBS, GenerationConfig, is_int
from ..text.tokenizer import check_text

# Request fields that set a GenerationConfig field of the same name (declared there).
DLLM_FIELDS = tuple(o["name"] for o in GenerationConfig.options() if o["server"])
# `fixed` in a request: {"5": " apples"} (JSON object keys are strings; positions as integers)
_KIND_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "text": str, "fixed": dict[str, str]}
MAX_N = 32
MAX_STOP = 16
IGNORABLE = (
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
)


# ---- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _loc_to_param(loc, kind: str) -> str | None:
    """The request path of an error location (`messages[0].content`): field names of our request
    models and list indices; pydantic also puts union-member tags ('str', 'list[str]') into
    locations, which are not field names and are left out. An unknown field keeps its name."""
    names = _field_names()
    out = ""
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part in names or (last and kind in ("extra_forbidden", "missing"))):
            out += ("." if out else "") + part
    return out or None


def _field_names() -> set[str]:
    models = (ContentPart, ImageURL, ImagePart, ChatMessage, StreamOptions, ChatCompletionRequest, CompletionRequest)
    return {name for m in models for name in m.model_fields}


def validation_error(errors: list[dict]) -> APIError:
    """The one mapping of a request's validation errors (FastAPI's, locations under "body") onto
    an OpenAI error: the first error, its parameter path, a code."""
    err = errors[0]
    kind, loc = err["type"], tuple(err["loc"])
    if loc[:1] == ("body",):
        loc = loc[1:]
    param = _loc_to_param(loc, kind)
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error") or err["msg"].removeprefix("Invalid JSON: ")
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    if (kind in ("model_type", "model_attributes_type", "dict_type") or kind == "missing") and not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_body")
    if kind == "extra_forbidden":
        hint = "; use max_tokens" if loc and loc[-1] == "gen_length" else ""
        return APIError(400, f"unknown field {param!r}{hint}", param=param, code="unknown_field")
    if kind == "missing":
        return APIError(400, f"{param}: required field is missing", param=param, code="missing_field")
    msg = err["msg"].removeprefix("Value error, ")
    field = msg.split(":", 1)[0]
    if kind == "value_error" and field in _field_names() and msg.startswith(field + ": "):
        # a check across a model's fields names the field it faults first: that field is the param
        param, msg = f"{param}.{field}" if param else field, msg[len(field) + 2 :]
        code = "missing_field" if msg.startswith("required") else "invalid_value"
        return APIError(400, f"{param}: {msg}", param=param, code=code)
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# ---- request bodies ----------------------------------------------------------------------------
def _check_unicode(value) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which is no character: no tokenizer
    takes it, so it is refused as an invalid value of its field."""
    if isinstance(value, str):
        check_text(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_unicode(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value):
        _check_unicode(value)
        return value


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data:image/...;base64 URL (the server fetches nothing)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[ContentPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self):
        # as OpenAI's API answers them: each a 400 naming the field
        if self.tool_calls is not None and not self.tool_calls:
            raise ValueError("tool_calls: an empty array; give at least one call, or leave the field out")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has them (this one is a {self.role} message)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: required in a tool message (the id of the call it answers)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls may omit it)")
        if self.images() and self.role != "user":
            raise ValueError(f"content: image_url parts are for user messages (this one is a {self.role} message)")
        return self

    def images(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, ContentPart))

    def for_template(self) -> dict:
        """The message as a chat template takes it (`tool_calls.template_messages` finishes it): a
        content with images as transformers' templates read one, a list of {"type": "image"} and
        {"type": "text", "text": ...} parts; else its text."""
        role = "system" if self.role == "developer" else self.role
        content = None if self.content is None else self.text()
        if self.images():
            content = [
                {"type": "text", "text": p.text} if isinstance(p, ContentPart) else {"type": "image"}
                for p in self.content
            ]
        return {
            "role": role,
            "content": content,
            "name": self.name,
            "tool_calls": self.tool_calls,
            "tool_call_id": self.tool_call_id,
        }


class StreamOptions(_Strict):
    include_usage: bool = False
    # an extension: each step's canvas as `event: canvas` chunks with no choices (`Answer.canvas_chunks`)
    include_canvas: bool = False


_DecodingFields = create_model(
    "_DecodingFields",
    __base__=_Strict,
    **{
        o["name"]: (_KIND_TYPES[o["kind"].removeprefix("optional ")] | None, Field(default=None, description=o["help"]))
        for o in GenerationConfig.options()
        if o["server"]
    },
)


class _Common(_DecodingFields):
    model: str
    preset: str | None = None  # a named decoding preset the server knows (`fastdllm serve --presets`)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None

    # Fields that frameworks send (LangChain, LiteLLM, agent SDKs) and that cannot change a diffusion
    # answer in their harmless form: accepted and ignored, and named in the X-Fastdllm-Ignored header.
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    logit_bias: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def ignored_fields(self) -> list[str]:
        """The fields given that have no effect here (see IGNORABLE)."""
        meaningful = set()
        if self.response_format not in (None, {"type": "text"}):
            meaningful.add("response_format")
        if self.tools:  # with tools, both tools and tool_choice change the answer
            meaningful |= {"tools", "tool_choice"}
        given = [n for n in IGNORABLE if n in self.model_fields_set and n not in meaningful]
        if self.stream_options is not None and not self.stream:
            given.append("stream_options")
        return given

    def check_unsupported(self, strict: bool = False) -> None:
        """400 for what would change the answer and is not implemented; with `strict`, also for
        every field that would otherwise be ignored."""
        if strict:
            for name in self.ignored_fields():
                if name == "stream_options":
                    raise APIError(
                        400, "stream_options: only allowed with stream: true", param=name, code="invalid_value"
                    )
                raise APIError(400, f"unknown field {name!r}", param=name, code="unknown_field")
        from ..text.tool_calls import check_tools

        try:
            check_tools(self.tools or [], self.tool_choice)
        except ValueError as e:
            param = str(e).split(":", 1)[0].split("[", 1)[0]
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        if (
            self.tools
            and self.tool_choice not in (None, "none", "auto")
            and self.response_format not in (None, {"type": "text"})
        ):
            raise APIError(
                400,
                "response_format: cannot be combined with tool_choice required or a named tool "
                "(each constrains the whole answer)",
                param="response_format",
                code="invalid_value",
            )
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind not in ("text", "json_object", "json_schema"):
                raise APIError(
                    400,
                    f"response_format: type must be text, json_object or json_schema (got {kind!r})",
                    param="response_format",
                    code="invalid_value",
                )
            spec = self.response_format.get("json_schema")
            if kind == "json_schema" and not (
                isinstance(spec, dict)
                and isinstance(spec.get("name"), str)
                and isinstance(spec.get("schema", {}), dict)
            ):
                raise APIError(
                    400,
                    "response_format: json_schema must be an object with a name and a schema object",
                    param="response_format",
                    code="invalid_value",
                )
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported (only empty)", param="logit_bias", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise APIError(
                    400, f"{name}: not supported by diffusion decoding (only 0)", param=name, code="unsupported_value"
                )
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings", param="stop", code="invalid_value")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None

    def check_unsupported(self, strict: bool = False) -> None:
        super().check_unsupported(strict)
        if not isinstance(self.logprobs, (bool, type(None))):
            raise APIError(400, "logprobs: true or false", param="logprobs", code="invalid_value")
        if self.top_logprobs is not None:
            if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(
                    400, f"top_logprobs: an integer 0-{MAX_LOGPROBS}", param="top_logprobs", code="invalid_value"
                )
            if not self.logprobs:
                raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")

    def reported_logprobs(self) -> int | None:
        """`GenerationConfig.logprobs`: the top tokens to report per token, None for none."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None

    def check_unsupported(self, strict: bool = False) -> None:
        super().check_unsupported(strict)
        if self.echo:  # scoring the prompt (lm-eval's local-completions): log-probabilities, no decoding
            if not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise APIError(
                    400,
                    f"logprobs: with echo, an integer 0-{MAX_LOGPROBS} (the top tokens reported per position)",
                    param="logprobs",
                    code="invalid_value",
                )
            if self.max_tokens not in (None, 0, 1):
                raise APIError(
                    400,
                    "max_tokens: with echo, 0 or 1 (echo scores the prompt, it does not decode)",
                    param="max_tokens",
                    code="invalid_value",
                )
            if self.stream or self.n != 1:
                raise APIError(400, "echo: not with stream or n > 1", param="echo", code="invalid_value")
        elif self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise APIError(
                400, f"logprobs: an integer 0-{MAX_LOGPROBS} (the top tokens reported per token)", param="logprobs"
            )
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: not supported (only 1)", param="best_of", code="unsupported_value")

    def reported_logprobs(self) -> int | None:
        """`GenerationConfig.logprobs`: the top tokens to report per token, None for none."""
        return None if self.echo else self.logprobs


class TokenizeRequest(_Strict):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]
