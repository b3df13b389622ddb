"""The OpenAI-compatible HTTP ingress (Ray Serve + FastAPI), also callable through a Serve handle.

Routes::

    POST /v1/chat/completions   POST /v1/completions   (stream: SSE, ends with ``data: [DONE]``)
    GET  /v1/models             GET  /v1/models/{id}   GET|HEAD /health   GET /v1/conflux/stats (router + instances)
    POST /tokenize              POST /detokenize       GET /version       (vLLM's shapes: tokenize_endpoints.py)

CORS headers (and preflight ``OPTIONS`` answers) only for ``allowed_origins``; with none configured a
preflight gets 405 like any unknown method.

``/health`` and ``/v1/models`` answer 503 (``Retry-After``) until every XP instance has loaded its
weights and finished its warm-up (its replica is running): once they answer 200, the first
request meets warmed-up instances. Requests sent earlier wait for the instances. Later, ``/health``
answers 503 ``no_healthy_instance`` while the router has no instance up (each is being rebuilt after
losing a worker), so load balancers and probes stop sending traffic.

With any API key configured (``api_key``, ``api_keys_file``, ``$CONFLUX_API_KEYS``) every ``/v1`` route
needs ``Authorization: Bearer <key>`` (scheme case-insensitive; 401 otherwise); ``/health`` stays open
and there is no ``/openapi.json`` or ``/docs``. Every error is ``{"error": {"message", "type", "param",
"code"}}`` (unknown routes and wrong methods too) and every response carries ``x-request-id``.

A request cannot stall the others: its body is refused (413) past ``max_request_bytes`` before it is
read, JSON nested deeper than 64 levels is a 400, templating and tokenization run in a worker thread
(bodies over ``LARGE_BODY_BYTES`` in their own small pool), and ``request_timeout_s`` bounds it (408).
Error messages name the request's ``x-request-id`` (Ray Serve's request id), never internals.

Handle API (from a Ray job or task; see docs/serving.md)::

    h = serve.get_app_handle("conflux")
    await h.chat.remote({"model": ..., "messages": [...]})         -> ChatCompletion as a dict
    await h.completions.remote({"model": ..., "prompt": "..."})    -> Completion as a dict
    async for text in h.options(stream=True).chat_stream.remote({...}):  -> text deltas
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.config import ServeConfig, unsendable_key
from conflux_cluster.engine.util.gc_heap import freeze_heap
from conflux_cluster.engine.loader import load_tokenizer, resolve_model
from conflux_cluster.router.policies import RoutingPolicy

from .backend import ServeBackend
from .errors import (APIError, body_timed_out, client_error, draining, http_error, model_not_found, not_decoded,
                     not_json, printable, starting, timed_out, too_large, unauthorized, unavailable)
from .gate import AdmissionGate, GatedBackend
from .handlers import Backend, Deadline, OpenAIServing, parse_body, validate_request
from .protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields, new_id,
                       now)
from .reasoning import ReasoningParser
from .request_params import ServingOptions, generation_defaults, read_chat_template
from .tokenize_endpoints import add_routes as add_tokenize_routes

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponse

    from conflux_cluster.engine.loader import ModelSource

log = logging.getLogger(__name__)

API_KEYS_ENV = "CONFLUX_API_KEYS"  # comma-separated API keys, read by each ingress replica
LARGE_BODY_BYTES = 256 * 1024  # bodies above this are prepared in the large-body pool (~0.2 s of tokenizing)
LARGE_BODY_THREADS = 2  # at most this many large bodies are tokenized at once per ingress replica
REQUEST_ID = "conflux.request_id"  # ASGI scope key: the id of this request in logs and ``x-request-id``
HEALTH_TIMEOUT_S = 2.0  # /health: how long the router may take to say which instances are up
HEALTH_RETRY_S = 5  # /health while no instance is up: Retry-After


class APIKeys:
    """The accepted API keys. Only SHA-256 digests are kept; a check hashes the given key and compares it
    with every digest (``hmac.compare_digest``, no early exit), so its time depends on neither the key
    nor which key matched."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]

    @classmethod
    def from_config(cls, config: ServeConfig, environ: Mapping[str, str] = os.environ) -> "APIKeys":
        """``api_key``, the lines of ``api_keys_file`` and ``$CONFLUX_API_KEYS``; a start-up error names a
        key file that cannot be read or holds no key, and where a key is that no client could send."""
        keys = [config.api_key] if config.api_key else []
        if config.api_keys_file is not None:
            keys += _read_keys_file(config.api_keys_file)
        env_keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        for k in env_keys:
            if unsendable_key(k):
                raise ValueError(f"{API_KEYS_ENV}: a key {unsendable_key(k)}")
        return cls(keys + env_keys)

    def check(self, authorization: str | None) -> str:
        """The client's id for rate limiting (``""`` when no key is configured), or raise 401. Only
        ``Bearer <key>`` (scheme case-insensitive) is accepted. The id is a prefix of the key's SHA-256
        digest: it tells keys apart in the router without the key leaving this replica."""
        if not self._digests:
            return ""
        scheme, _, key = (authorization or "").strip().partition(" ")
        given = _digest(key.strip())
        matched = False
        for d in self._digests:
            matched |= hmac.compare_digest(given, d)
        if not (matched and scheme.lower() == "bearer" and key.strip()):
            raise unauthorized()
        return given.hex()[:16]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _read_keys_file(path: Path) -> list[str]:
    try:
        lines = path.expanduser().read_text().splitlines()
    except OSError as e:
        raise ValueError(f"api_keys_file: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"api_keys_file: {path} is not UTF-8 text") from None
    keys = [ln.split("#", 1)[0].strip() for ln in lines]
    for n, k in enumerate(keys, 1):
        if k and unsendable_key(k):
            raise ValueError(f"api_keys_file: {path} line {n}: the key {unsendable_key(k)}")
    keys = [k for k in keys if k]
    if not keys:
        raise ValueError(f"api_keys_file: {path} holds no key")
    return keys


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` bytes: from ``Content-Length`` before
    reading anything, else while streaming (at most ``limit`` bytes plus one chunk are ever held); 408
    when it has not all arrived after ``timeout_s``. 415 before reading when ``Content-Type`` says it is
    not JSON (``is_json``), or ``Content-Encoding`` says it is encoded (gzip, ...: nothing here decodes it)."""
    content_type = request.headers.get("content-type")
    if not is_json(content_type):
        raise not_json(content_type or "")
    encoding = request.headers.get("content-encoding", "")
    if any(e.strip().lower() not in ("", "identity") for e in encoding.split(",")):
        raise not_decoded(encoding)
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timed_out(timeout_s or 0.0) from None
    return b"".join(chunks)


def is_json(content_type: str | None) -> bool:
    """Whether a body of ``content_type`` is read as JSON: none given (as FastAPI reads it), ``application/json``
    or an ``application/...+json`` type, with any parameters. Not text or a form: a browser sends those
    cross-origin without a CORS preflight, so a page could make a keyless server generate."""
    if not content_type:
        return True
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


class OpenAIIngress:
    """Serve deployment body of the ingress; the FastAPI app is built per replica. ``backend`` replaces the
    router + instances transport (tests of the HTTP layer without Ray)."""

    def __init__(self, config: ServeConfig, router: DeploymentHandle, instances: Sequence[DeploymentHandle],
                 backend: Backend | None = None, elastic: bool = False) -> None:
        self.config = config
        self.router = router
        self.instances = list(instances)
        self.elastic = elastic  # instances follow the nodes: any of them may be down (serve/elastic.py)
        source = resolve_model(config.model)
        limit = source.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.keys = APIKeys.from_config(config)
        # the Ray transport (None: an injected backend); warmed once the instances are ready
        self._transport = None if backend else ServeBackend(router, self.instances, self._prefix_block_tokens())
        # refusals before any per-request work, from the router's queue state (serve/gate.py)
        self.gate = AdmissionGate(router.queue_view.remote if router is not None else None)
        # HTTP generation requests past the gate whose response has not started (a stream: not yet handed
        # to its instance, which counts it from then on); the drain waits for both (serve/drain.py)
        self.open_requests = 0
        self.serving = OpenAIServing(config.model_name, load_tokenizer(source), self.max_model_len,
                                     GatedBackend(backend or self._transport, self.gate),
                                     vocab_size=source.config.vocab_size,
                                     max_tokens_limit=config.max_tokens_limit, options=serving_options(config, source))
        self._large_bodies = ThreadPoolExecutor(LARGE_BODY_THREADS, thread_name_prefix="ingress-large-body")
        self.created = now()
        self._ready = False  # every instance replica answered once (then it stays true)
        self.metrics = None
        try:
            from conflux_cluster.metrics import IngressMetrics

            self.metrics = IngressMetrics(config.model_name)
        except Exception:  # noqa: BLE001 - metrics are optional
            log.warning("ingress metrics disabled", exc_info=True)
        if config.freeze_gc and backend is None:  # a Serve replica (not an in-process test): see engine/util/gc_heap.py
            freeze_heap()

    def __del__(self) -> None:
        """Serve calls this when the replica stops: end its instance feeds, or each XP replica would wait
        its whole graceful-shutdown timeout on a feed whose reader is gone."""
        transport = getattr(self, "_transport", None)
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - interpreter teardown: no event loop left
                pass

    def _prefix_block_tokens(self) -> int | None:
        """Tokens per prefix block the router hashes (only for the prefix_aware policy)."""
        if self.config.router_policy is RoutingPolicy.PREFIX_AWARE:
            return self.config.router_prefix_block_tokens
        return None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    # ---- shared by HTTP and handles ----------------------------------------------------------

    def check_key(self, authorization: str | None) -> str:
        """The client's id (see ``APIKeys.check``), or 401."""
        return self.keys.check(authorization)

    def record_error(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.record_error(status)

    async def instances_ready(self, timeout_s: float | None = 0.5) -> bool:
        """True once every instance replica has answered (it is running: weights loaded, warmed up).
        Their answer is their effective context (the engine caps it to what one rank's KV pool
        holds): from then on requests are validated against the smallest. Elastic instances (all of
        one shape): once any has answered; requests never wait for one (the router answers 503
        while none is up)."""
        if self._ready:
            return True
        if self.elastic:
            live = await self.router.live_instances.remote()
            limits = await _answers([self.instances[i].max_model_len for i in live[:1]],
                                    30.0 if timeout_s is None else timeout_s)
        else:
            try:
                limits = await asyncio.wait_for(
                    asyncio.gather(*[h.max_model_len.remote() for h in self.instances]), timeout_s)
            except asyncio.TimeoutError:
                return False
        if self.elastic and not limits:
            return False
        if limits:
            self.max_model_len = min(self.max_model_len, *limits)
            self.serving.max_model_len = self.max_model_len
        if self._transport is not None and not self.elastic:
            await self._transport.warm()  # the first request would pay for it
        await self.gate.refresh_now()  # the gate's first view: a burst as the first traffic is bounded too
        self._ready = True
        return True

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.config.model_name, created=self.created, max_model_len=self.max_model_len)

    async def some_instance_live(self) -> bool:
        """Whether the router has an instance up now: none while each is rebuilt after losing a worker
        (requests get 503 ``no_healthy_instance`` then, and so does ``/health``)."""
        if self.router is None:  # an injected backend (tests of the HTTP layer)
            return True
        try:
            return bool(await asyncio.wait_for(self.router.live_instances.remote(), HEALTH_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - the router does not answer: nothing can be routed
            log.warning("the router did not answer the health check", exc_info=True)
            return False

    async def prepare(self, raw: bytes, cls: type[SamplingFields], response_id: str,
                      arrival: float, client: str = "") -> tuple[SamplingFields, list[GenerateRequest]]:
        """Parse, validate, template and tokenize in a worker thread (the event loop keeps serving others);
        a large body goes to its own small pool so that large bodies never hold up small ones."""
        def work() -> tuple[SamplingFields, list[GenerateRequest]]:
            req = parse_body(raw, cls)
            return req, self.serving.prepare(req, response_id, arrival, client)

        pool = self._large_bodies if len(raw) > LARGE_BODY_BYTES else None
        return await asyncio.get_running_loop().run_in_executor(pool, work)

    async def openai_http(self, request: Request, cls: type[SamplingFields], prefix: str) -> Response:
        """One ``/v1/chat/completions`` or ``/v1/completions`` request, from key check to response."""
        arrival = time.time()
        request_id, response_id = request.scope[REQUEST_ID], new_id(prefix)
        deadline = Deadline.after(self.config.request_timeout_s)
        client = self.check_key(request.headers.get("authorization"))
        refusal = self.gate.enter(response_id)  # before any per-request work: read, parse, tokenize
        if refusal is not None:
            raise refusal
        timeout = asyncio.timeout_at(deadline.at if deadline else None)
        self.open_requests += 1
        try:
            async with timeout:
                raw = await read_body(request, self.config.max_request_bytes, self.config.body_timeout_s)
                await self.instances_ready(timeout_s=None)  # (once) the instances' effective context
                req, engine_reqs = await self.prepare(raw, cls, response_id, arrival, client)
                if self.metrics is not None:
                    self.metrics.record_priority(req.priority)
                if req.stream:  # routed before the status line; the deadline then travels with the stream
                    events = await self.serving.stream(req, engine_reqs, deadline, request_id)
                    return StreamingResponse(events, media_type="text/event-stream")
                resp = await self.serving.respond(req, engine_reqs)
            return JSONResponse(resp.model_dump())
        except TimeoutError as e:
            if deadline is not None and timeout.expired():
                raise timed_out(deadline.seconds) from None
            raise client_error(e, request_id, response_id) from None
        except Exception as e:  # noqa: BLE001 - an APIError as it is; anything else sanitized and logged
            raise client_error(e, request_id, response_id) from None
        finally:
            self.gate.leave(response_id)
            self.open_requests -= 1

    # ---- drain (serve/drain.py) ----------------------------------------------------------------

    def begin_drain(self) -> int:
        """Admit nothing from now on (503 ``server_draining``; ``/health`` 503): the open requests go on.
        Returns how many are open in this replica."""
        self.gate.draining = True
        return self.open_requests

    def num_open_requests(self) -> int:
        return self.open_requests

    # ---- handle API --------------------------------------------------------------------------

    async def _prepared(self, cls: type[SamplingFields], body: object,
                        **fixed: Any) -> tuple[Any, list[GenerateRequest]]:
        """A handle caller's ``body`` (anything: not a dict is the 400 the HTTP path gives) with ``fixed``
        fields set, validated and tokenized."""
        req = validate_request(cls, body, fixed=fixed)
        await self.instances_ready(timeout_s=None)
        return req, await asyncio.to_thread(self.serving.prepare, req)

    # Every error a handle caller gets is an APIError, as an HTTP client gets one: ``client_error`` makes one of
    # anything else (an instance failure: 503; an engine's ValueError: 400; a bug: 500 naming the call's id,
    # logged in full), so no remote traceback, path or pid reaches the caller.

    async def chat(self, body: dict) -> dict:
        call_id = new_id("req")
        try:
            req, engine_reqs = await self._prepared(ChatCompletionRequest, body, stream=False)
            return (await self.serving.chat(req, engine_reqs)).model_dump()
        except Exception as e:  # noqa: BLE001 - an APIError as it is; anything else sanitized and logged
            raise client_error(e, call_id) from None

    async def completions(self, body: dict) -> dict:
        call_id = new_id("req")
        try:
            req, engine_reqs = await self._prepared(CompletionRequest, body, stream=False)
            return (await self.serving.completion(req, engine_reqs)).model_dump()
        except Exception as e:  # noqa: BLE001 - as in chat
            raise client_error(e, call_id) from None

    async def chat_stream(self, body: dict) -> AsyncIterator[str]:
        """Text deltas of choice 0 of a chat request (n must be 1)."""
        call_id = new_id("req")
        try:
            _, engine_reqs = await self._prepared(ChatCompletionRequest, body, stream=False, n=1)
            async with self.serving.deltas(engine_reqs) as deltas:
                async for _, delta in deltas:
                    if delta.text:
                        yield delta.text
        except Exception as e:  # noqa: BLE001 - as in chat
            raise client_error(e, call_id) from None

    async def cluster_stats(self) -> dict:
        """Router decisions and per-instance counters (control-plane share included)."""
        snap = await self.router.snapshot.remote()
        if self.elastic:  # only the instances that are up (a call to a slot without a replica starts one)
            live = await self.router.live_instances.remote()
            stats = await _answers([self.instances[i].control_plane for i in live], 10.0)
        else:
            stats = await asyncio.gather(*[h.control_plane.remote() for h in self.instances])
        ingress = {"refused_at_gate": self.gate.refused, "open_requests": self.open_requests,
                   "draining": self.gate.draining}  # the answering ingress replica's own
        return {"router": snap.__dict__, "instances": list(stats), "ingress": ingress}


async def _answers(methods: Sequence[DeploymentHandle], timeout_s: float) -> list[Any]:
    """Call each handle method; the answers that came within ``timeout_s``, in call order (a replica that
    died meanwhile does not answer; its call is cancelled)."""
    calls = [asyncio.ensure_future(_result(m.remote())) for m in methods]
    if not calls:
        return []
    done, pending = await asyncio.wait(calls, timeout=timeout_s)
    for c in pending:
        c.cancel()
    return [c.result() for c in calls if c in done and not c.cancelled() and c.exception() is None]


async def _result(response: DeploymentResponse) -> Any:
    return await response


class RequestIdHeader:
    """ASGI middleware: the request's id in ``scope[REQUEST_ID]``, the one its errors and log lines name.

    Behind Ray Serve that is Serve's request id: its proxy puts ``x-request-id`` on the request (the
    client's own, else a fresh one), returns it on the response and tags the replica's log lines with
    it. Without one (the app served directly) a fresh ``req-…`` is made and sent back as ``x-request-id``.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        scope[REQUEST_ID] = printable(given, 128) or new_id("req")
        if given:  # whoever set it (Serve's proxy) sends it back
            return await self.app(scope, receive, send)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", scope[REQUEST_ID].encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class OpenAICORS(CORSMiddleware):
    """Starlette's CORS, except that a refused preflight (an origin, method or header ``allowed_origins`` does
    not allow) is a 400 in OpenAI's error shape like every other error here, not Starlette's plain text."""

    def preflight_response(self, request_headers: Any) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = response.body.decode(errors="replace").removeprefix("Disallowed CORS ")  # "origin, method"
        err = APIError(400, f"CORS preflight refused: {refused} not allowed by this server (allowed_origins).",
                       "invalid_request_error", None, "cors_not_allowed")
        keep = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return JSONResponse(err.body(), status_code=400, headers=keep)


class StripTrailingSlash:
    """ASGI middleware: ``/v1/models/`` routes as ``/v1/models``. Without it a trailing slash is a 307
    redirect, which clients may follow without their POST body, or not at all."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
        await self.app(scope, receive, send)


def serving_options(config: ServeConfig, source: ModelSource) -> ServingOptions:
    """The OpenAI layer's options from the config (a start-up error names a bad chat template or
    generation_config)."""
    parser = ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None
    return ServingOptions(max_logprobs=config.max_logprobs,
                          defaults=generation_defaults(config.generation_config, source),
                          chat_template=read_chat_template(config.chat_template), reasoning_parser=parser)


def build_api(ing: OpenAIIngress) -> FastAPI:
    """FastAPI routes over one ``OpenAIIngress`` (closures; no module-level app)."""
    api = FastAPI(title="ConfluxServe", openapi_url=None, docs_url=None, redoc_url=None)
    api.add_middleware(RequestIdHeader)
    api.add_middleware(StripTrailingSlash)
    if ing.config.allowed_origins:  # outermost: a preflight is answered before anything else looks at it
        api.add_middleware(OpenAICORS, allow_origins=ing.config.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])

    def render(e: APIError) -> JSONResponse:
        ing.record_error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @api.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return render(e)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return render(http_error(e.status_code, request.method, request.url.path, e.headers))

    @api.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:  # a bug: runs outside RequestIdHeader
        request_id = request.scope.get(REQUEST_ID, "unknown")
        response = render(client_error(e, request_id))
        if "x-request-id" not in request.headers:
            response.headers["x-request-id"] = request_id
        return response

    @api.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health() -> dict:
        if ing.gate.is_draining():  # shutting down: load balancers stop sending (serve/drain.py)
            raise draining()
        if not await ing.instances_ready():
            raise starting()
        if not await ing.some_instance_live():  # every instance is being rebuilt: probes stop sending
            raise unavailable(HEALTH_RETRY_S)
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(request: Request) -> dict:
        ing.check_key(request.headers.get("authorization"))
        if not await ing.instances_ready():
            raise starting()
        return ModelList(data=[ing.model_card()]).model_dump()

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        ing.check_key(request.headers.get("authorization"))
        if model_id != ing.config.model_name:
            raise model_not_found(model_id, ing.config.model_name)
        if not await ing.instances_ready():
            raise starting()
        return ing.model_card().model_dump()

    @api.get("/v1/conflux/stats")
    async def stats(request: Request) -> dict:
        ing.check_key(request.headers.get("authorization"))
        return await ing.cluster_stats()

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await ing.openai_http(request, ChatCompletionRequest, "chatcmpl")

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await ing.openai_http(request, CompletionRequest, "cmpl")

    async def read_tokenize_body(request: Request) -> bytes:
        raw = await read_body(request, ing.config.max_request_bytes, ing.config.body_timeout_s)
        await ing.instances_ready(timeout_s=None)  # (once) the served context, which /tokenize reports
        return raw

    add_tokenize_routes(api, ing.serving, ing.check_key, read_tokenize_body)

    return api
