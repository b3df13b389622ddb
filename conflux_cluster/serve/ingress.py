"""The OpenAI-compatible HTTP ingress (Ray Serve + FastAPI), also callable through a Serve handle.

Routes::

    POST /v1/chat/completions   POST /v1/completions   (stream: SSE, ends with ``data: [DONE]``)
    GET  /v1/models             GET  /health           GET /v1/conflux/stats (router + instances)

``/health`` and ``/v1/models`` answer 503 (``Retry-After``) until every XP instance has loaded its
weights and finished its warm-up (its replica is running): once they answer 200, the first
request meets warmed-up instances. Requests sent earlier wait for the instances.

With ``api_key`` set, every ``/v1`` route needs ``Authorization: Bearer <key>`` (401 otherwise).
Every error is ``{"error": {"message", "type", "param", "code"}}``.

Handle API (from a Ray job or task; see docs/serving.md)::

    h = serve.get_app_handle("conflux")
    await h.chat.remote({"model": ..., "messages": [...]})         -> ChatCompletion as a dict
    await h.completions.remote({"model": ..., "prompt": "..."})    -> Completion as a dict
    async for text in h.options(stream=True).chat_stream.remote({...}):  -> text deltas
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from pydantic import ValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.loader import load_tokenizer, resolve_model

from .backend import ServeBackend
from .errors import APIError, from_validation_error, starting, unauthorized
from .handlers import OpenAIServing, parse_body
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now

log = logging.getLogger(__name__)


class OpenAIIngress:
    """Serve deployment body of the ingress; the FastAPI app is built per replica."""

    def __init__(self, config: ServeConfig, router: Any, instances: Sequence[Any]) -> None:
        self.config = config
        self.router = router
        self.instances = list(instances)
        source = resolve_model(config.model)
        limit = source.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.serving = OpenAIServing(config.model_name, load_tokenizer(source), self.max_model_len,
                                     ServeBackend(router, self.instances))
        self.created = now()
        self._ready = False  # every instance replica answered once (then it stays true)
        self.metrics = None
        try:
            from conflux_cluster.metrics import IngressMetrics

            self.metrics = IngressMetrics(config.model_name)
        except Exception:  # noqa: BLE001 - metrics are optional
            log.warning("ingress metrics disabled", exc_info=True)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    # ---- shared by HTTP and handles ----------------------------------------------------------

    def check_key(self, authorization: str | None) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise unauthorized()

    def record_error(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.record_error(status)

    async def instances_ready(self, timeout_s: float = 0.5) -> bool:
        """True once every instance replica has answered (it is running: weights loaded, warmed up)."""
        if not self._ready:
            try:
                await asyncio.wait_for(asyncio.gather(*[h.num_open_streams.remote() for h in self.instances]),
                                       timeout_s)
                self._ready = True
            except asyncio.TimeoutError:
                return False
        return True

    # ---- handle API --------------------------------------------------------------------------

    async def chat(self, body: dict) -> dict:
        req = _validate(ChatCompletionRequest, {**body, "stream": False})
        resp = await self.serving.chat(req, self.serving.prepare_chat(req))
        return resp.model_dump()

    async def completions(self, body: dict) -> dict:
        req = _validate(CompletionRequest, {**body, "stream": False})
        resp = await self.serving.completion(req, self.serving.prepare_completion(req))
        return resp.model_dump()

    async def chat_stream(self, body: dict) -> AsyncIterator[str]:
        """Text deltas of choice 0 of a chat request (n must be 1)."""
        req = _validate(ChatCompletionRequest, {**body, "stream": False, "n": 1})
        async for _, delta in self.serving.merged(self.serving.prepare_chat(req)):
            if delta.text:
                yield delta.text

    async def cluster_stats(self) -> dict:
        """Router decisions and per-instance counters (control-plane share included)."""
        snap = await self.router.snapshot.remote()
        stats = await asyncio.gather(*[h.control_plane.remote() for h in self.instances])
        return {"router": snap.__dict__, "instances": list(stats)}


def _validate(cls: type, body: dict) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def build_api(ing: OpenAIIngress) -> FastAPI:
    """FastAPI routes over one ``OpenAIIngress`` (closures; no module-level app)."""
    api = FastAPI(title="ConfluxServe", docs_url=None, redoc_url=None)

    @api.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        ing.record_error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @api.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in the ingress")
        ing.record_error(500)
        err = APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")
        return JSONResponse(err.body(), status_code=500)

    @api.get("/health")
    async def health() -> dict:
        if not await ing.instances_ready():
            raise starting()
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(request: Request) -> dict:
        ing.check_key(request.headers.get("authorization"))
        if not await ing.instances_ready():
            raise starting()
        card = ModelCard(id=ing.config.model_name, created=ing.created, max_model_len=ing.max_model_len)
        return ModelList(data=[card]).model_dump()

    @api.get("/v1/conflux/stats")
    async def stats(request: Request) -> dict:
        ing.check_key(request.headers.get("authorization"))
        return await ing.cluster_stats()

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        ing.check_key(request.headers.get("authorization"))
        req = parse_body(await request.body(), ChatCompletionRequest)
        engine_reqs = ing.serving.prepare_chat(req)
        if req.stream:
            return StreamingResponse(ing.serving.chat_stream(req, engine_reqs), media_type="text/event-stream")
        return JSONResponse((await ing.serving.chat(req, engine_reqs)).model_dump())

    @api.post("/v1/completions")
    async def completions(request: Request):
        ing.check_key(request.headers.get("authorization"))
        req = parse_body(await request.body(), CompletionRequest)
        engine_reqs = ing.serving.prepare_completion(req)
        if req.stream:
            return StreamingResponse(ing.serving.completion_stream(req, engine_reqs),
                                     media_type="text/event-stream")
        return JSONResponse((await ing.serving.completion(req, engine_reqs)).model_dump())

    return api
