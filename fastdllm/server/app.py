"""The FastAPI application: routes, request -> GenerationConfig, responses and streaming."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ConfigError, GenerationConfig
from ..engine.constraints import GrammarConstraint, response_format_constraint
from ..engine.generation import generate
from ..engine.likelihood import prefix_logprobs
from ..text import tool_calls
from .guard import Guard
from .incremental import ChoiceText
from .metrics import ServerMetrics
from .scheduler import BlockFinal, Job, JobEnded, JobFailed, QueueFull, Scheduler
from .schema import (
    DLLM_FIELDS,
    MAX_N,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    validation_error,
)

log = logging.getLogger("fastdllm.server")


# ---- the application ----------------------------------------------------------------------------
@dataclass
class ServerSettings:
    model_name: str
    defaults: GenerationConfig
    max_batch_size: int = 8
    max_queue: int = 64
    batch_wait: float = 0.0
    block_hook: Callable[[int], None] | None = None  # called by the worker after each block
    aliases: tuple[str, ...] = ()  # more ids clients may use for the model
    strict: bool = False  # refuse the fields that are otherwise accepted and ignored
    api_key: str | None = None  # when set, every route but /health and /version needs "Bearer <key>"
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    continuous: bool = True  # requests join the running batch at its next block boundary
    tool_call_parser: str | None = None  # "hermes" | "llama3_json" (None: the one the chat template teaches)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model_name, *[a for a in self.aliases if a != self.model_name])


def default_model_name(path: str | None) -> str:
    """The id served for `--model PATH`: the embedded model's name, else PATH as given (a hub id
    keeps its organisation: `Dream-org/Dream-v0-Instruct-7B`), as vLLM serves it."""
    if path is None:
        return "llada-arith"
    return str(path).rstrip("/") or str(path)


class Server:
    """The state behind the routes: model, tokenizer, server defaults and the scheduler."""

    def __init__(self, model, tokenizer, settings: ServerSettings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.scoring_lock = threading.Lock()  # scoring forwards run one request at a time, off the event loop
        self.scheduler = Scheduler(
            model,
            settings.max_batch_size,
            settings.max_queue,
            settings.batch_wait,
            settings.block_hook,
            continuous=settings.continuous,
        )
        self.created = int(time.time())
        self.warmed, self.warm_error = False, None  # set by the app's warm-up decode

    def not_ready(self) -> str | None:
        """Why the server cannot answer a request now (None: it can)."""
        if not self.warmed:
            return "warming up"
        if self.warm_error is not None:
            return f"the warm-up decode failed: {self.warm_error}"
        s = self.scheduler
        if s.closing:
            return "shutting down"
        if not s.thread.is_alive():
            return "the inference worker stopped"
        if len(s.pending) >= s.max_queue:
            return f"the queue is full ({len(s.pending)} requests)"
        if s.paused:
            return "paused"
        return None

    # -- request -> rows and config
    def check_model(self, name: str) -> None:
        if name not in self.settings.names:
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.settings.names)}",
                param="model",
                code="model_not_found",
            )

    def config_for(self, req: _Common, max_tokens: int | None) -> tuple[GenerationConfig, int]:
        """The request's GenerationConfig (seed None) and the number of tokens to keep."""
        base = self.settings.defaults.replace(seed=None)
        overrides: dict[str, Any] = {}
        for name in DLLM_FIELDS:
            if name in req.model_fields_set:
                overrides[name] = getattr(req, name)
        for name in ("temperature", "top_p"):
            if getattr(req, name) is not None:
                overrides[name] = getattr(req, name)
        keep = max_tokens if max_tokens is not None else base.gen_length
        try:
            config = base.with_max_new_tokens(keep, **overrides)
        except ConfigError as e:
            param = "max_tokens" if e.param in ("gen_length", "max_new_tokens") else e.param
            raise APIError(400, f"{param}: {e.detail}", param=param, code="invalid_value") from None
        return config, keep

    def base_seed(self, req: _Common) -> int:
        if req.seed is not None:
            return req.seed
        if self.settings.defaults.seed is not None:
            return self.settings.defaults.seed
        return random.randrange(2**31 - 1)

    def check_context(self, prompts: list[list[int]], config: GenerationConfig, param: str) -> None:
        limit = self.model.args.max_seq_len
        longest = max(len(p) for p in prompts)
        if longest + config.gen_length > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has {longest} tokens and "
                f"max_tokens asks for {config.gen_length} (rounded up to whole blocks of {config.block_length})",
                param=param,
                code="context_length_exceeded",
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
            )
        messages = tool_calls.template_messages([m.for_template() for m in req.messages])
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if tools and not tool_calls.template_reads_tools(self.tokenizer.chat_template):
            messages = [tool_calls.tools_system_message(tools), *messages]  # the template would drop them
            tools = None
        try:
            return self.tokenizer.encode_chat(messages, tools=tools)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(
                400, f"messages: the chat template rejected them ({e})", param="messages", code="invalid_value"
            ) from None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.tokenizer.encode(p, add_special_tokens=False)]
        elif not p:
            raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        elif isinstance(p[0], str):
            prompts = [self.tokenizer.encode(s, add_special_tokens=False) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(x) for x in p]
        vocab = self.model.args.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
            if any(not 0 <= t < vocab or t == self.model.mask_token_id for t in ids):
                raise APIError(
                    400,
                    f"prompt: token ids must be in [0, {vocab}) and not the mask token",
                    param="prompt",
                    code="invalid_value",
                )
        return prompts


class ChatEndpoint:
    """/v1/chat/completions: what differs from /v1/completions, in one place."""

    request_model = ChatCompletionRequest
    id_prefix, object, chunk_object, prompt_param = "chatcmpl", "chat.completion", "chat.completion.chunk", "messages"
    opens_with_role = True

    @staticmethod
    def max_tokens(req):
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens

    @staticmethod
    def prompts(server, req):
        return [server.chat_prompt(req)]

    @staticmethod
    def prompt_chars(req) -> int:
        return sum(len(m.text()) for m in req.messages)

    @staticmethod
    def choice(i, ch, calls=None) -> dict:
        """`calls`: (content, OpenAI tool_calls) when the answer called tools."""
        message = {"role": "assistant", "content": ch.text}
        finish = ch.finish_reason
        if calls:
            message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
            finish = "tool_calls"
        return {"index": i, "message": message, "logprobs": None, "finish_reason": finish}

    @staticmethod
    def chunk_choice(i, delta, finish, role=False, calls=None) -> dict:
        d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
        if calls:
            d = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return {"index": i, "delta": d, "logprobs": None, "finish_reason": finish}


class CompletionEndpoint:
    """/v1/completions."""

    request_model = CompletionRequest
    id_prefix, object, chunk_object, prompt_param = "cmpl", "text_completion", "text_completion", "prompt"
    opens_with_role = False

    @staticmethod
    def max_tokens(req):
        return req.max_tokens

    @staticmethod
    def prompts(server, req):
        return server.completion_prompts(req)

    @staticmethod
    def prompt_chars(req) -> int:
        p = req.prompt
        return len(p) if isinstance(p, str) else sum(len(x) if isinstance(x, (str, list)) else 1 for x in p)

    @staticmethod
    def choice(i, ch) -> dict:
        return {"index": i, "text": ch.text, "logprobs": None, "finish_reason": ch.finish_reason}

    @staticmethod
    def chunk_choice(i, delta, finish, role=False) -> dict:
        return {"index": i, "text": delta or "", "logprobs": None, "finish_reason": finish}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class RequestMetrics:
    """ASGI middleware: counts each request by route and status and times it to its last byte
    (a stream's last chunk too). Plain ASGI, so that a client that goes away early is ordinary:
    nothing raises into the log on its behalf."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, done = time.perf_counter(), [500], [False]

        def record():
            if not done[0]:
                done[0] = True
                path = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.requests.labels(path, str(status[0])).inc()
                self.metrics.latency.labels(path).observe(time.perf_counter() - t0)

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()  # the last byte: a stream's end, not its headers

        try:
            await self.app(scope, receive, send_counted)
        finally:
            record()


def create_app(model, tokenizer, settings: ServerSettings) -> FastAPI:
    server = Server(model, tokenizer, settings)

    async def lifespan(app):
        warming = asyncio.create_task(warm_up())
        yield
        warming.cancel()
        server.scheduler.close()

    app = FastAPI(
        title="fastdllm",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible server for diffusion language models",
    )
    app.state.server = server
    app.state.scheduler = server.scheduler
    metrics = ServerMetrics(server.scheduler, settings.model_name)
    server.scheduler.batch_hook = metrics.on_batch
    app.state.metrics = metrics
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    app.add_middleware(RequestMetrics, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"Unknown route: {request.method} {request.url.path}", code="not_found").response()
        if exc.status_code == 405:
            return APIError(
                405, f"Method {request.method} not allowed on {request.url.path}", code="method_not_allowed"
            ).response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, **server.scheduler.snapshot()}

    @app.get("/ready")
    async def ready():
        """Ready to answer: the weights warmed by one decode through the scheduler, which is
        accepting (its worker alive, not shutting down or paused, room in the queue). /health only
        says the process is alive; a load balancer's health check (Ray Serve's) reads this."""
        reason = server.not_ready()
        if reason is not None:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        return {"status": "ready", "model": settings.model_name}

    @app.get("/version")
    async def version():
        from ..version import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give prompt or messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            tokens = server.chat_prompt(ChatCompletionRequest(model=req.model, messages=req.messages))
        else:
            tokens = tokenizer.encode(req.prompt, add_special_tokens=False)
        return {"count": len(tokens), "max_model_len": model.args.max_seq_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        vocab = model.args.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens", code="invalid_value")
        return {"prompt": tokenizer.decode(req.tokens)}

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "fastdllm",
            "max_model_len": model.args.max_seq_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in settings.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        server.check_model(model_id)
        return model_card(model_id)

    async def warm_up():
        """One short decode with the server's defaults (its kernels loaded, a compiled model's graphs
        built); /ready waits for it. It runs beside the scheduler and counts as no request."""
        config = settings.defaults.with_max_new_tokens(1)
        try:
            await asyncio.to_thread(generate, model, [[model.args.eos_token_id]], config=config)
        except Exception as e:  # the model cannot decode: say so on /ready, keep serving /health
            log.exception("warm-up failed")
            server.warm_error = f"{type(e).__name__}: {e}"
        server.warmed = True

    async def submit(prompts, seeds, config, constraints=None) -> Job:
        job = Job(prompts, seeds, config, asyncio.get_running_loop(), constraints=constraints)
        try:
            server.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), "server_error", code="queue_full") from None
        return job

    async def events(job: Job, request: Request, watch_disconnect: bool):
        """The job's events; when not streaming, checks every second that the client is still there."""
        while True:
            if watch_disconnect:
                try:
                    item = await asyncio.wait_for(job.events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        server.scheduler.cancel(job)
                        return
                    continue
            else:
                item = await job.events.get()
            yield item
            if isinstance(item, (JobEnded, JobFailed)):
                return

    async def run(endpoint, req, request: Request):
        arrival = time.perf_counter()
        server.check_model(req.model)
        req.check_unsupported(settings.strict)
        ignored = req.ignored_fields()
        headers = {"X-Fastdllm-Ignored": ", ".join(ignored)} if ignored else {}
        if ignored:
            log.info("request fields accepted and ignored: %s", ", ".join(ignored))
        # A prompt of more characters than the context could hold tokens (~32 characters per token
        # at most) is refused before tokenising; tokenising runs off the event loop.
        chars, limit = endpoint.prompt_chars(req), 32 * model.args.max_seq_len
        if chars > limit:
            raise APIError(
                400,
                f"{endpoint.prompt_param}: {chars} characters cannot fit the model's context of "
                f"{model.args.max_seq_len} tokens",
                param=endpoint.prompt_param,
                code="context_length_exceeded",
            )
        prompts = await asyncio.to_thread(endpoint.prompts, server, req)
        config, keep = server.config_for(req, endpoint.max_tokens(req))
        server.check_context(prompts, config, endpoint.prompt_param)
        seed = server.base_seed(req)
        limit = max(MAX_N, settings.max_batch_size)
        if len(prompts) * req.n > limit:
            raise APIError(
                400,
                f"n: prompts x n = {len(prompts) * req.n} choices; at most {limit} per request",
                param="n",
                code="invalid_value",
            )
        rows = [p for p in prompts for _ in range(req.n)]
        seeds = [seed + i for _ in prompts for i in range(req.n)]
        stop = req.stop_list()
        choices = [ChoiceText(tokenizer, model.stop_token_ids, stop, keep) for _ in rows]
        prompt_tokens = sum(len(p) for p in prompts)
        constraints = None
        tool_mode = None  # "auto": calls parsed from the answer; "forced": the answer is the calls
        if getattr(req, "tools", None) and req.tool_choice != "none":
            if endpoint is not ChatEndpoint:
                raise APIError(400, "tools: only for /v1/chat/completions", param="tools", code="invalid_value")
            tool_mode = "auto" if req.tool_choice in (None, "auto") else "forced"
        if tool_mode == "forced":
            schema = tool_calls.forced_schema(req.tools, req.tool_choice)
            try:
                constraints = [
                    GrammarConstraint.json(tokenizer, model.stop_token_ids, schema, what="tools", budget=keep)
                    for _ in rows
                ]
            except ValueError as e:
                raise APIError(400, str(e), param="tools", code="invalid_value") from None
        elif getattr(req, "response_format", None) not in (None, {"type": "text"}):
            try:  # one grammar state per row
                constraints = [
                    response_format_constraint(req.response_format, tokenizer, model.stop_token_ids, budget=keep)
                    for _ in rows
                ]
            except ValueError as e:
                raise APIError(400, str(e), param="response_format", code="invalid_value") from None
        job = await submit(rows, seeds, config, constraints)
        meta = {
            "id": f"{endpoint.id_prefix}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()),
            "model": settings.model_name,
        }
        last_block = config.num_blocks - 1

        last_block_at = [None]

        def on_block(item) -> list[tuple[int, str, bool]]:
            """Feed a block to every choice: [(index, new text, became final)]."""
            now = time.perf_counter()
            metrics.on_block(arrival, last_block_at[0], now)
            last_block_at[0] = now
            out = []
            for i, ch in enumerate(choices):
                if ch.final:
                    continue
                delta = ch.feed(item.tokens[i], item.finished[i], item.block == last_block)
                out.append((i, delta, ch.final))
            if all(ch.final for ch in choices):
                job.satisfied = True
            return out

        parse = tool_calls.PARSERS[settings.tool_call_parser or tool_calls.parser_for_template(tokenizer.chat_template)]

        def calls_of(ch) -> tuple[str | None, list[dict]] | None:
            """(content, OpenAI tool_calls) of a finished choice that called tools, else None."""
            if tool_mode is None:
                return None
            if tool_mode == "forced":
                found = tool_calls.forced_calls(ch.text, req.tool_choice)
                content = None
            else:
                content, found = parse(ch.text)
            return (content, tool_calls.openai_calls(found)) if found else None

        def finish_all() -> list[tuple[int, str, bool]]:
            out = []
            for i, ch in enumerate(choices):
                if not ch.final:
                    out.append((i, ch.feed([], False, True), True))
            return out

        if not req.stream:
            ended = False
            try:
                async for item in events(job, request, watch_disconnect=True):
                    if isinstance(item, JobFailed):
                        ended = True
                        raise item.error
                    if isinstance(item, JobEnded):
                        ended = True
                    elif isinstance(item, BlockFinal):
                        on_block(item)
                        if job.satisfied:
                            ended = True
                            break
                if not ended:  # the client went away while waiting
                    return JSONResponse({}, status_code=499)
                finish_all()
            finally:
                if not ended:
                    server.scheduler.cancel(job)
            metrics.on_done(prompt_tokens, sum(ch.num_tokens for ch in choices), time.perf_counter() - arrival)
            return JSONResponse(
                {
                    **meta,
                    "object": endpoint.object,
                    "system_fingerprint": None,
                    "choices": [
                        endpoint.choice(i, ch, calls_of(ch)) if tool_mode else endpoint.choice(i, ch)
                        for i, ch in enumerate(choices)
                    ],
                    "usage": _usage(prompt_tokens, sum(ch.num_tokens for ch in choices)),
                },
                headers=headers,
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        obj = endpoint.chunk_object

        def chunk(i: int, delta: str | None, finish: str | None, role: bool = False) -> str:
            c = endpoint.chunk_choice(i, delta, finish, role)
            body = {**meta, "object": obj, "system_fingerprint": None, "choices": [c]}
            if include_usage:
                body["usage"] = None
            return _sse(body)

        def render(updates) -> list[str]:
            out = []
            for i, delta, became_final in updates:
                if tool_mode:  # a tool-calling answer is sent whole once final: calls or text
                    if became_final:
                        calls = calls_of(choices[i])
                        if calls is None:
                            if choices[i].text:
                                out.append(chunk(i, choices[i].text, None))
                            out.append(chunk(i, None, choices[i].finish_reason))
                            continue
                        if calls[0]:
                            out.append(chunk(i, calls[0], None))
                        c = endpoint.chunk_choice(i, None, None, calls=calls[1])
                        out.append(
                            _sse(
                                {
                                    **meta,
                                    "object": obj,
                                    "system_fingerprint": None,
                                    "choices": [c],
                                    **({"usage": None} if include_usage else {}),
                                }
                            )
                        )
                        out.append(chunk(i, None, "tool_calls"))
                    continue
                if delta:
                    out.append(chunk(i, delta, None))
                if became_final:
                    out.append(chunk(i, None, choices[i].finish_reason))
            return out

        async def stream():
            done = False
            try:
                if endpoint.opens_with_role:
                    for i in range(len(choices)):
                        yield chunk(i, None, None, role=True)
                async for item in events(job, request, watch_disconnect=False):
                    if isinstance(item, JobFailed):
                        yield _sse(item.error.body())
                        yield "data: [DONE]\n\n"
                        done = True
                        return
                    if isinstance(item, BlockFinal):
                        for s in render(on_block(item)):
                            yield s
                        if job.satisfied:
                            break
                for s in render(finish_all()):
                    yield s
                if include_usage:
                    yield _sse(
                        {
                            **meta,
                            "object": obj,
                            "system_fingerprint": None,
                            "choices": [],
                            "usage": _usage(prompt_tokens, sum(ch.num_tokens for ch in choices)),
                        }
                    )
                yield "data: [DONE]\n\n"
                done = True
                metrics.on_done(prompt_tokens, sum(ch.num_tokens for ch in choices), time.perf_counter() - arrival)
            finally:
                if not done:  # the client went away (the response task was cancelled)
                    server.scheduler.cancel(job)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await run(ChatEndpoint, req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if req.echo:
            return await score(req)
        return await run(CompletionEndpoint, req, request)

    async def score(req: CompletionRequest):
        """echo + logprobs: each prompt token's log-probability given the tokens before it (the later
        ones masked; `likelihood.prefix_logprobs`), and with max_tokens 1 the next token, in
        OpenAI's completions `logprobs` layout, as lm-eval's local-completions reads it."""
        arrival = time.perf_counter()
        server.check_model(req.model)
        req.check_unsupported(settings.strict)
        prompts = await asyncio.to_thread(server.completion_prompts, req)
        extra = req.max_tokens or 0
        for p in prompts:
            if len(p) + extra > model.args.max_seq_len:
                raise APIError(
                    400,
                    f"prompt: {len(p)} tokens exceed the model's context of {model.args.max_seq_len}",
                    param="prompt",
                    code="context_length_exceeded",
                )

        def compute():
            with server.scoring_lock:
                return [prefix_logprobs(model, p, top=max(1, req.logprobs), extra=extra) for p in prompts]

        results = await asyncio.to_thread(compute)
        choices = []
        for i, (toks, lps, tops) in enumerate(results):
            pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in toks]
            offsets = [sum(len(x) for x in pieces[:k]) for k in range(len(pieces))]
            top = [
                None
                if t is None
                else {tokenizer.decode([a], skip_special_tokens=False): b for a, b in t[: req.logprobs]}
                for t in tops
            ]
            choices.append(
                {
                    "index": i,
                    "text": "".join(pieces),
                    "finish_reason": "length",
                    "logprobs": {"tokens": pieces, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets},
                }
            )
        prompt_tokens = sum(len(p) for p in prompts)
        metrics.on_done(prompt_tokens, extra * len(prompts), time.perf_counter() - arrival)
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex[:24]}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": settings.model_name,
                "system_fingerprint": None,
                "choices": choices,
                "usage": _usage(prompt_tokens, extra * len(prompts)),
            }
        )

    return app
