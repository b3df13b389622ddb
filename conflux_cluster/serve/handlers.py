"""OpenAI request -> engine requests -> OpenAI response. No HTTP and no Ray here: the transport is a
``Backend`` (routing + per-request token streams), so this layer is the same behind FastAPI and
behind a Serve handle.

One OpenAI request with ``n`` choices becomes ``n`` engine requests (choice ``i`` gets the seed the
offline ``LLM`` would give it), all routed to one instance; their delta streams are merged.

Everything the engine would reject (token ids, context length, ``max_tokens``, sampling parameters) is
checked by ``prepare`` (CPU work: the ingress runs it in a worker thread), and a stream is routed before
its first event (``stream``), so a bad request or a full cluster gets an HTTP status, not a 200 with an
in-band error. Errors after the first event end the stream in-band: every unfinished choice gets
``finish_reason: "abort"``, then one error event (``errors.client_error``: no internals), then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Protocol, Sequence

from pydantic import ValidationError

from conflux_cluster.engine.contracts.request import ContextLengthExceeded, resolve_max_tokens
from conflux_cluster.engine.util.seeds import mix_seed
from conflux_cluster.engine.tokenizer import ChatTemplateOptions, out_of_vocab
from conflux_cluster.engine.contracts.stream import TokenDelta
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.structured.spec import StructuredOutput

from .errors import (bad_request, client_error, context_too_long, from_validation_error, model_not_found,
                     printable, timed_out)
from .json_body import (MAX_JSON_DEPTH, SURROGATE_ESCAPE, nested_deeper_than, read_json,
                        reject_lone_surrogates, too_deep)
from .tools import ToolCallStream, conversation, output_guide, parse_message, tool_format, uses_tools
from .protocol import (ChatChoice, ChatChoiceMessage, ChatChunkChoice, ChatCompletionChunk,
                       ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs, CompletionChoice,
                       CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                       PromptTokensDetails, SamplingFields, UsageInfo, new_id, now, unimplemented_fields,
                       unknown_fields)
from .logprobs import chat_logprobs, completion_logprobs, echoed_completion_logprobs, prompt_logprobs
from .reasoning import ReasoningStream, split_reasoning
from .request_params import (ServingOptions, check_logprobs, check_token_ids, choice_params, default_max_tokens,
                             sampling_error, template_options)

log = logging.getLogger(__name__)

STREAM_OPEN = ""  # first item of every stream generator: routing is done, the status line may go out
ABORTED = "abort"  # finish_reason of a choice a stream error or the deadline ended


class Backend(Protocol):
    """Where engine requests run: picks an instance and streams its deltas."""

    async def generate(self, requests: Sequence[GenerateRequest]) -> Sequence[AsyncIterator[TokenDelta]]:
        """Route the requests (together, to one instance) and return one delta stream per request."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def chat_prompt_ids(self, conversation: list[dict[str, Any]], options: ChatTemplateOptions | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    @property
    def chat_template(self) -> str | None: ...


@dataclass
class _Choice:
    """Accumulated output of one choice."""

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # per token, when asked
    prompt_logprobs: tuple | None = None  # per prompt position (PromptLogprob or None), when asked
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


@dataclass(frozen=True)
class Deadline:
    """When a request must be done: ``at`` in event-loop time (``loop.time()``), from a limit of ``seconds``."""

    at: float
    seconds: float

    @classmethod
    def after(cls, seconds: float | None) -> "Deadline | None":
        return None if seconds is None else cls(asyncio.get_running_loop().time() + seconds, seconds)

    def left(self) -> float:
        return self.at - asyncio.get_running_loop().time()


def parse_body(raw: bytes, model_cls: type[SamplingFields], max_depth: int = MAX_JSON_DEPTH) -> SamplingFields:
    """Bytes -> validated request, or an APIError(400) naming the bad field."""
    return validate_request(model_cls, read_json(raw, max_depth),
                            check_unicode=SURROGATE_ESCAPE.search(raw) is not None, check_depth=False)


_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
               type(None): "null"}


def _kind(value: object) -> str:
    """What a body that is not an object is, in JSON's words; a Serve handle caller's other Python object (a
    request model, as Ray Serve LLM's handles take) by its type, with what to pass instead."""
    kind = _JSON_KINDS.get(type(value))
    if kind is not None:
        return kind
    return (f"a {printable(type(value).__name__, 64)} (a Serve handle takes the request as a dict of its fields, "
            "e.g. request.model_dump(exclude_unset=True))")


def validate_request(model_cls: type[SamplingFields], data: object, check_unicode: bool = True,
                     fixed: Mapping[str, Any] | None = None, check_depth: bool = True) -> SamplingFields:
    """A parsed body (JSON from HTTP, or whatever a Serve handle caller passed) -> validated request, or an
    APIError(400) naming the bad field; anything but a JSON object (a dict) is a 400. A top-level field
    neither OpenAI nor vLLM has is a 400 naming it (``unknown_fields``); a parameter that would change the
    output and is not implemented here is a 400 (``UNIMPLEMENTED``).
    ``check_unicode``: look for lone surrogates in the strings (``parse_body`` does only when the raw
    body has such an escape; a Serve handle's dict is always looked at). ``fixed``: fields the caller
    sets over the body's (a handle method's ``stream=False``). ``check_depth``: refuse nesting deeper than
    ``MAX_JSON_DEPTH`` (``parse_body`` checks the raw body instead; a handle's dict has no text to scan, and a
    JSON Schema hundreds deep, or one holding itself, would make the schema checks recurse without bound)."""
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, not {_kind(data)}", code="invalid_json")
    if check_depth and nested_deeper_than(data, MAX_JSON_DEPTH):
        raise too_deep(MAX_JSON_DEPTH)
    if fixed:
        data = {**data, **fixed}
    if check_unicode:
        reject_lone_surrogates(data)
    unsupported = unimplemented_fields(data, model_cls)
    if unsupported:
        raise bad_request(f"{', '.join(unsupported)}: not supported by this server", param=unsupported[0])
    unknown = unknown_fields(model_cls, data)
    if unknown:
        raise bad_request(f"{', '.join(printable(u, 64) for u in unknown[:5])}: unknown request field "
                          f"(see docs/serving.md for the fields this server takes)", param=printable(unknown[0], 64),
                          code="unknown_field")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


class OpenAIServing:
    """The OpenAI endpoints' logic over one served model."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, max_model_len: int, backend: Backend,
                 vocab_size: int, max_tokens_limit: int | None = None, options: ServingOptions | None = None) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.backend = backend
        self.vocab_size = vocab_size  # prompt token ids must be in [0, vocab_size) (the engine's rule)
        self.max_tokens_limit = max_tokens_limit  # ceiling on max_tokens (None: the rest of the context)
        self.options = options or ServingOptions()
        # the template chats are rendered with: --chat-template's, else the model's; its family's tool-call
        # format and whether it renders tools follow it (serve/tools.py)
        self.chat_template = self.options.chat_template or tokenizer.chat_template
        self.tool_format = tool_format(self.chat_template)

    # ---- request -> engine requests ----------------------------------------------------------

    def _check_model(self, req: SamplingFields) -> None:
        if req.model != self.model_name:
            raise model_not_found(req.model, self.model_name)

    def refuse_longer_than_context(self, texts: list[str], param: str) -> None:
        """Refuse text that cannot fit the context before tokenizing it (a 4 MB prompt took 22 s of CPU to be
        refused after tokenizing): each token stands for at most the tokenizer's ``max_token_bytes`` bytes
        of text, so text of more than that × ``max_model_len`` bytes is longer than the context. Twice that,
        for normalizers that shorten text (NFKC) and special tokens written in the text."""
        per = getattr(self.tokenizer, "max_token_bytes", None)
        if not per:
            return
        size = sum(len(t) for t in texts)  # characters <= UTF-8 bytes: checking characters first is free
        if size <= 2 * per * self.max_model_len:
            return
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        least = size // (2 * per)
        if least > self.max_model_len:
            raise context_too_long(ContextLengthExceeded(least, None, self.max_model_len, at_least=True), param)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        options = template_options(req, self.options)
        if not req.tools and not any(m.tool_calls for m in req.messages):  # the plain path, as before tools
            conv: list[dict[str, Any]] = [{"role": m.role, "content": m.text(),
                                           **({"name": m.name} if m.name is not None else {}),
                                           **({"reasoning_content": m.reasoning_content}
                                              if m.reasoning_content is not None else {})}
                                          for m in req.messages]
            self.refuse_longer_than_context([m["content"] for m in conv], "messages")
            if options == ChatTemplateOptions():  # the plain path (tokenizers without template options)
                return self.tokenizer.chat_prompt_ids(conv)
            try:
                return self.tokenizer.chat_prompt_ids(conv, options)
            except ValueError as e:  # a template variable or option the template cannot take
                raise bad_request(str(e), param="chat_template_kwargs") from None
        conv, tools = conversation(req, self.chat_template)
        self.refuse_longer_than_context([m.get("content") or "" for m in conv] + [json.dumps(tools or "")], "messages")
        try:
            return self.tokenizer.chat_prompt_ids(conv, options, tools)
        except (TypeError, ValueError) as e:  # the template refused the conversation (raise_exception)
            raise bad_request(f"messages: the chat template cannot render this conversation: {e}"[:500],
                              param="messages") from None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of the batch (``CompletionRequest.prompts``)."""
        out, prompts = [], req.prompts()
        for j, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{j}]"
            if not p:
                raise bad_request(f"{where}: must not be empty", param="prompt")
            if isinstance(p, list):
                bad = out_of_vocab(p, self.vocab_size)
                if bad:
                    raise bad_request(f"{where}: token ids {bad[:3]} are outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="prompt", code="invalid_token_id")
                out.append(list(p))
            else:
                self.refuse_longer_than_context([p], "prompt")
                out.append(self.tokenizer.encode(p))
        return out

    def engine_requests(self, req: SamplingFields, prompt: list[int], max_new: int | None, logprobs: int | None,
                        base: str, arrival: float, client: str = "", first: int = 0,
                        structured: StructuredOutput | None = None) -> list[GenerateRequest]:
        """Validate lengths and sampling as the engine will and build the n engine requests ``f"{base}-{k}"``,
        k = ``first`` + i (``arrival``: time.time() when the request reached the ingress; TTFT counts from it)."""
        limit, field = self.max_tokens_limit, req.max_tokens_field()
        max_new = default_max_tokens(req, max_new, self.options.defaults)
        if max_new is not None and limit is not None and max_new > limit:
            raise bad_request(f"{field}: {max_new} is more than this server allows ({limit})",
                              param=field, code="max_tokens_exceeded")
        try:
            budget = resolve_max_tokens(len(prompt), max_new, self.max_model_len)
        except ContextLengthExceeded as e:
            chat = isinstance(req, ChatCompletionRequest)
            raise context_too_long(e, "messages" if chat else "prompt", field) from None
        if max_new is None and limit is not None:
            budget = min(budget, limit)  # no max_tokens: the rest of the context, up to the server's ceiling
        max_new = budget
        out = []
        for i in range(req.n):
            params = choice_params(req, self.options, max_new, choice_seed(req.seed, i, req.n), logprobs)
            update = {"structured": structured} if structured is not None else {}
            if req.reject_unattainable:
                update["reject_unattainable"] = True
            if update:  # validated again: a constraint does not combine with every option (ignore_eos)
                try:
                    params = type(params).model_validate({**dict(params), **update})
                except ValidationError as e:
                    raise sampling_error(e) from None
            out.append(GenerateRequest(f"{base}-{first + i}", prompt, params, arrival=arrival, client=client,
                                       priority=req.priority))
        return out

    def prepare(self, req: SamplingFields, base: str | None = None,
                arrival: float | None = None, client: str = "") -> list[GenerateRequest]:
        """Template, tokenize and validate: the request's engine requests, or an APIError(4xx). CPU work
        (seconds for a body of megabytes): callers on an event loop run it in a worker thread. ``base``: the
        response id (default a new one); ``arrival``: time.time() the request arrived (default now); ``client``:
        the API key's id (rate limit)."""
        arrival = time.time() if arrival is None else arrival
        self._check_model(req)
        check_logprobs(req, self.options.max_logprobs)
        check_token_ids(req, self.vocab_size)
        guide = output_guide(req, self.tool_format)  # response_format / structured_outputs / tool_choice
        if isinstance(req, ChatCompletionRequest):
            return self.engine_requests(req, self.chat_prompt(req), req.max_new_tokens(), req.logprobs_count(),
                                        base or new_id("chatcmpl"), arrival, client, structured=guide)
        assert isinstance(req, CompletionRequest), type(req)
        base = base or new_id("cmpl")
        return [r for j, prompt in enumerate(self.completion_prompts(req))
                for r in self.engine_requests(req, prompt, req.max_new_tokens(), req.logprobs, base,
                                              arrival, client, first=j * req.n, structured=guide)]

    async def respond(self, req: SamplingFields, requests: list[GenerateRequest]
                      ) -> ChatCompletionResponse | CompletionResponse:
        """The whole (non-streamed) response."""
        if isinstance(req, ChatCompletionRequest):
            return await self.chat(req, requests)
        return await self.completion(req, requests)

    async def stream(self, req: SamplingFields, requests: list[GenerateRequest], deadline: Deadline | None = None,
                     request_id: str | None = None) -> AsyncIterator[str]:
        """Route the request, then hand back its SSE events. A routing or admission error raises here, before
        the caller sends a status line; later errors end the stream in-band, naming ``request_id`` (default
        the response id). Past ``deadline`` the stream ends with a 408 error event (its requests aborted)."""
        make = self.chat_stream if isinstance(req, ChatCompletionRequest) else self.completion_stream
        events = make(req, requests, deadline, request_id)
        first = await anext(events)  # runs the generator through routing (``deltas``)
        assert first == STREAM_OPEN, first
        return events

    # ---- merged delta streams ----------------------------------------------------------------

    @asynccontextmanager
    async def deltas(self, requests: list[GenerateRequest], deadline: Deadline | None = None
                     ) -> AsyncIterator[AsyncIterator[tuple[int, TokenDelta]]]:
        """Route ``requests`` (errors raise on entry) and merge their delta streams: ``(choice index,
        delta)`` in arrival order until every choice finished; past ``deadline`` a 408. Leaving the block
        cancels every stream (the instance aborts its request and frees its KV)."""
        streams = await self.backend.generate(requests)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
        try:
            yield _merged(queue, len(tasks), deadline)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, requests: list[GenerateRequest]) -> list[_Choice]:
        choices = [_Choice(token_ids=[], logprobs=[], top_logprobs=[]) for _ in requests]
        async with self.deltas(requests) as deltas:
            async for i, d in deltas:
                c = choices[i]
                c.text += d.text
                c.token_ids.extend(d.token_ids)
                c.logprobs.extend(d.logprobs)
                c.top_logprobs.extend(d.top_logprobs)
                c.prompt_logprobs = c.prompt_logprobs or d.prompt_logprobs
                c.prompt_tokens, c.output_tokens = d.num_prompt_tokens, d.num_output_tokens
                c.cached_tokens = max(c.cached_tokens, d.num_cached_tokens)
                if d.finished:
                    c.finish_reason = d.finish_reason
        return choices

    @staticmethod
    def usage(choices: Sequence[_Choice], requests: Sequence[GenerateRequest], n: int) -> UsageInfo:
        """Every prompt counted once (choices come ``n`` per prompt, in order), as OpenAI counts a batch."""
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests[::n])
        completion = sum(c.output_tokens for c in choices)
        cached = sum(max(c.cached_tokens for c in choices[j:j + n]) for j in range(0, len(choices), n))
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    # ---- chat --------------------------------------------------------------------------------

    def _chat_message(self, req: ChatCompletionRequest, c: _Choice) -> tuple[ChatChoiceMessage, str | None]:
        """The choice's message and finish reason: the reasoning parser's split (``--reasoning-parser``), then
        with tools the content parsed into content and calls."""
        parser, text, reasoning = self.options.reasoning_parser, c.text, None
        if parser is not None:
            split = split_reasoning(parser, text)
            text, reasoning = split.content, split.reasoning
        if not uses_tools(req):
            return ChatChoiceMessage(content=text, reasoning_content=reasoning), c.finish_reason
        content, calls = parse_message(req, self.tool_format, text or "")
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return ChatChoiceMessage(content=content, tool_calls=calls or None, reasoning_content=reasoning), reason

    async def chat(self, req: ChatCompletionRequest, requests: list[GenerateRequest]) -> ChatCompletionResponse:
        choices = await self.collect(requests)
        k = req.top_logprobs or 0
        messages = [self._chat_message(req, c) for c in choices]
        out = [ChatChoice(index=i, message=messages[i][0], finish_reason=messages[i][1],
                          logprobs=chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, c.top_logprobs, k,
                                                 req.skip_special_tokens) if req.logprobs else None,
                          token_ids=c.token_ids if req.return_token_ids else None)
               for i, c in enumerate(choices)]
        scores = prompt_logprobs(self.tokenizer, requests[0].prompt_token_ids, choices[0].prompt_logprobs,
                                 req.prompt_logprobs or 0)
        return ChatCompletionResponse(id=response_id(requests), created=now(),
                                      model=self.model_name, choices=out,
                                      usage=self.usage(choices, requests, req.n), prompt_logprobs=scores)

    async def chat_stream(self, req: ChatCompletionRequest, requests: list[GenerateRequest],
                          deadline: Deadline | None = None, request_id: str | None = None) -> AsyncIterator[str]:
        """``STREAM_OPEN`` once routed, then SSE ``data:`` lines: a role chunk per choice, content chunks,
        optional usage, ``[DONE]`` (use through ``stream``)."""
        rid, created = response_id(requests), now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        finals = [_Choice() for _ in requests]
        parser = self.options.reasoning_parser
        splits = [ReasoningStream(parser) if parser is not None else None for _ in requests]

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and req.usage_every_chunk():
                usage = self.usage(finals, requests, req.n)
            c = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)
            data = c.model_dump(exclude=None if include_usage else {"usage"})
            for ch in data["choices"]:  # like OpenAI/vLLM: delta carries only what changed
                ch["delta"] = {k: v for k, v in ch["delta"].items() if v is not None}
            return sse(json.dumps(data))

        calls = [ToolCallStream.of(req, self.tool_format) for _ in requests] if uses_tools(req) else None

        def delta_message(i: int, d: TokenDelta) -> tuple[DeltaMessage, str | None]:
            if calls is not None or splits[i] is None:  # tool calls, or plain text
                return _chat_delta(d, calls[i] if calls else None)
            s = splits[i].feed(d.text)
            reasoning, content = s.reasoning or "", s.content or ""
            if d.finished:
                tail = splits[i].finish()
                reasoning, content = reasoning + (tail.reasoning or ""), content + (tail.content or "")
            reason = d.finish_reason if d.finished else None
            return DeltaMessage(content=content or None, reasoning_content=reasoning or None), reason

        async with self.deltas(requests, deadline) as deltas:
            yield STREAM_OPEN
            for i in range(len(requests)):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            try:
                async for i, d in deltas:
                    finals[i].output_tokens = d.num_output_tokens
                    finals[i].cached_tokens = max(finals[i].cached_tokens, d.num_cached_tokens)
                    lp = (chat_logprobs(self.tokenizer, d.token_ids, d.logprobs, d.top_logprobs, req.top_logprobs or 0,
                                        req.skip_special_tokens) if req.logprobs else None)
                    ids = list(d.token_ids) if req.return_token_ids else None
                    message, reason = delta_message(i, d)
                    if message.content or message.reasoning_content or message.tool_calls or d.finished or lp or ids:
                        yield chunk([ChatChunkChoice(index=i, delta=message, logprobs=lp, finish_reason=reason,
                                                     token_ids=ids)])
                    _mark_finished(finals[i], d)
            except Exception as e:  # noqa: BLE001 - the stream has started: end every choice, report in-band
                for i in _unfinished(finals):
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=ABORTED)])
                yield sse(json.dumps(client_error(e, request_id or rid, rid).body()))
        if include_usage:
            yield chunk([], self.usage(finals, requests, req.n))
        yield "data: [DONE]\n\n"

    # ---- completions -------------------------------------------------------------------------

    def _echo(self, req: CompletionRequest, requests: list[GenerateRequest], i: int) -> str:
        """Choice ``i``'s prompt text when ``echo`` is set, else "": a text prompt as sent, token ids decoded as the
        model read them (special tokens too: ``<|im_start|>`` is part of the prompt, as vLLM and OpenAI echo it)."""
        if not req.echo:
            return ""
        prompt = req.prompts()[i // req.n]
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(requests[i].prompt_token_ids, skip_special_tokens=False)

    def _completion_choice(self, req: CompletionRequest, requests: list[GenerateRequest], i: int,
                           c: _Choice) -> CompletionChoice:
        tok, prompt = self.tokenizer, requests[i].prompt_token_ids
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(tok, c.token_ids, c.logprobs, c.top_logprobs, req.logprobs, 0,
                                     req.skip_special_tokens)
            if req.echo:
                lp = echoed_completion_logprobs(tok, prompt, c.prompt_logprobs or (), req.logprobs, lp)
        scores = (prompt_logprobs(tok, prompt, c.prompt_logprobs, req.prompt_logprobs)
                  if req.prompt_logprobs is not None else None)
        return CompletionChoice(index=i, text=self._echo(req, requests, i) + c.text, finish_reason=c.finish_reason,
                                logprobs=lp, token_ids=c.token_ids if req.return_token_ids else None,
                                prompt_logprobs=scores)

    async def completion(self, req: CompletionRequest, requests: list[GenerateRequest]) -> CompletionResponse:
        choices = await self.collect(requests)
        if req.echo_only():  # the one token sampled is not part of the answer
            choices = [_Choice(prompt_logprobs=c.prompt_logprobs, token_ids=[],
                               finish_reason=ABORTED if c.finish_reason == ABORTED else "length",
                               logprobs=[], top_logprobs=[] if c.top_logprobs is not None else None,
                               prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens) for c in choices]
        out = [self._completion_choice(req, requests, i, c) for i, c in enumerate(choices)]
        return CompletionResponse(id=response_id(requests), created=now(),
                                  model=self.model_name, choices=out,
                                  usage=self.usage(choices, requests, req.n))

    async def completion_stream(self, req: CompletionRequest, requests: list[GenerateRequest],
                                deadline: Deadline | None = None, request_id: str | None = None
                                ) -> AsyncIterator[str]:
        """``STREAM_OPEN`` once routed, then SSE ``data:`` lines (use through ``stream``)."""
        rid, created = response_id(requests), now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        finals = [_Choice() for _ in requests]

        def chunk(choice: CompletionChoice) -> str:
            usage = self.usage(finals, requests, req.n) if req.usage_every_chunk() else None
            c = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice], usage=usage)
            return sse(c.model_dump_json(exclude={"usage"} if not include_usage else None))

        echo_at_first = req.echo and req.logprobs is not None  # the prompt's logprobs come with the first token

        def echo_chunk(i: int, d: TokenDelta) -> str:
            """The prompt's echo with its logprobs; later offsets count from the end of its tokens' text."""
            lp = echoed_completion_logprobs(self.tokenizer, requests[i].prompt_token_ids, d.prompt_logprobs or (),
                                            req.logprobs, CompletionLogprobs())
            finals[i].text = "".join(lp.tokens)
            return chunk(CompletionChoice(index=i, text=self._echo(req, requests, i), logprobs=lp))

        async with self.deltas(requests, deadline) as deltas:
            yield STREAM_OPEN
            for i in range(len(requests)) if req.echo and not echo_at_first else ():
                yield chunk(CompletionChoice(index=i, text=self._echo(req, requests, i)))
            try:
                async for i, d in deltas:
                    f = finals[i]
                    if echo_at_first and d.prompt_logprobs is not None:
                        yield echo_chunk(i, d)
                    if req.echo_only():  # the one token sampled is not part of the answer
                        f.cached_tokens = max(f.cached_tokens, d.num_cached_tokens)
                        if d.finished:
                            reason = ABORTED if d.finish_reason == ABORTED else "length"
                            yield chunk(CompletionChoice(index=i, text="", token_ids=[] if req.return_token_ids
                                                         else None, finish_reason=reason))
                            _mark_finished(f, d)
                        continue
                    lp = (completion_logprobs(self.tokenizer, d.token_ids, d.logprobs, d.top_logprobs, req.logprobs,
                                              len(f.text), req.skip_special_tokens)
                          if req.logprobs is not None else None)
                    f.text += d.text
                    f.output_tokens = d.num_output_tokens
                    f.cached_tokens = max(f.cached_tokens, d.num_cached_tokens)
                    ids = list(d.token_ids) if req.return_token_ids else None
                    if d.text or d.finished or ids or (lp and lp.tokens):  # a token without text still has logprobs
                        yield chunk(CompletionChoice(index=i, text=d.text, logprobs=lp, token_ids=ids,
                                                     finish_reason=d.finish_reason if d.finished else None))
                    _mark_finished(f, d)
            except Exception as e:  # noqa: BLE001 - the stream has started: end every choice, report in-band
                for i in _unfinished(finals):
                    yield chunk(CompletionChoice(index=i, text="", finish_reason=ABORTED))
                yield sse(json.dumps(client_error(e, request_id or rid, rid).body()))
        if include_usage:
            c = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                   usage=self.usage(finals, requests, req.n))
            yield sse(c.model_dump_json())
        yield "data: [DONE]\n\n"


async def _pump(i: int, stream: AsyncIterator[TokenDelta], queue: asyncio.Queue) -> None:
    """Copy choice ``i``'s deltas onto ``queue`` as ``(i, delta, None)``; an error as ``(i, None, exc)``;
    then ``(i, None, None)``."""
    try:
        async for delta in stream:
            await queue.put((i, delta, None))
    except Exception as e:  # noqa: BLE001 - forwarded to the consumer (which decides what a client sees)
        await queue.put((i, None, e))
    await queue.put((i, None, None))


async def _merged(queue: asyncio.Queue, n: int, deadline: Deadline | None) -> AsyncIterator[tuple[int, TokenDelta]]:
    """``_pump``'s items from ``n`` choices until all ended; the first error raises; past ``deadline`` a 408."""
    done = 0
    while done < n:
        try:
            i, delta, err = await asyncio.wait_for(queue.get(), None if deadline is None else deadline.left())
        except TimeoutError:
            raise timed_out(deadline.seconds) from None
        if err is not None:
            raise err
        if delta is None:
            done += 1
            continue
        yield i, delta


def _chat_delta(d: TokenDelta, calls: ToolCallStream | None) -> tuple[DeltaMessage, str | None]:
    """A streamed chat delta and its finish reason (with tools: the text parsed into content and calls)."""
    reason = d.finish_reason if d.finished else None
    if calls is None:
        return DeltaMessage(content=d.text or None), reason
    content, tool_calls = calls.feed(d.text, d.finished)
    if reason == "stop" and calls.called:
        reason = "tool_calls"
    return DeltaMessage(content=content, tool_calls=tool_calls or None), reason


def _mark_finished(choice: _Choice, delta: TokenDelta) -> None:
    if delta.finished:
        choice.finish_reason = delta.finish_reason or "stop"


def _unfinished(choices: Sequence[_Choice]) -> list[int]:
    """Indexes of the choices no finished delta has ended yet."""
    return [i for i, c in enumerate(choices) if c.finish_reason is None]


def choice_seed(seed: int | None, index: int, n: int) -> int | None:
    """Seed of choice ``index``: the request's seed when n == 1, else the offline LLM's derivation."""
    if seed is None or n == 1:
        return seed
    return mix_seed(seed, index) >> 1


def response_id(requests: list[GenerateRequest]) -> str:
    """The response's id: the base of its choices' request ids (``f"{base}-{i}"``, made by
    ``OpenAIServing.engine_requests``)."""
    return requests[0].request_id.rsplit("-", 1)[0]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
