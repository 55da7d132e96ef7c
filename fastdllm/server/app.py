"""The FastAPI application: middleware, error bodies and routes. What a route does lives beside
it: `state` reads a request, `responses` answers it."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .guard import Guard
from .metrics import ServerMetrics
from .responses import ChatEndpoint, CompletionEndpoint, answer, score
from .schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from .state import Server, ServerSettings

log = logging.getLogger("fastdllm.server")


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


def create_app(model, tokenizer, settings: ServerSettings, commands=None) -> FastAPI:
    """The app; `commands`: rank 0's `ranks.Commands` when the model is tensor-parallel."""
    server = Server(model, tokenizer, settings, commands)

    async def lifespan(app):
        warming = asyncio.create_task(server.warm_up())
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
    app.state.metrics = server.metrics
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=server.metrics)
    add_error_handlers(app)
    add_routes(app, server)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

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


def add_routes(app: FastAPI, server: Server) -> None:
    settings, model, tokenizer = server.settings, server.model, server.tokenizer

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
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give prompt or messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            chat = ChatCompletionRequest(model=req.model, messages=req.messages)
            tokens = server.place_images(chat, [server.chat_prompt(chat)], tower=False)[0][0]  # pictures placed
        else:
            tokens = tokenizer.encode(req.prompt)
        return {"count": len(tokens), "max_model_len": model.args.max_seq_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        vocab = model.args.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens", code="invalid_value")
        return {"prompt": tokenizer.decode(req.tokens)}

    def model_card(name: str) -> dict:
        card = {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "fastdllm",
            "max_model_len": model.args.max_seq_len,
        }
        if name in settings.adapters:  # as vLLM lists a LoRA module: its base model as root and parent
            card.update(root=model.lora.paths[model.lora.index(name)], parent=settings.model_name)
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in settings.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        server.check_model(model_id)
        return model_card(model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await answer(server, ChatEndpoint, req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if req.echo:
            return await score(server, req)
        return await answer(server, CompletionEndpoint, req, request)
