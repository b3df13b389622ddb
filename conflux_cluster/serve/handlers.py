"""OpenAI request -> engine requests -> OpenAI response. No HTTP and no Ray here: the transport is a
``Backend`` (routing + per-request token streams), so this layer is the same behind FastAPI and
behind a Serve handle.

One OpenAI request with ``n`` choices becomes ``n`` engine requests (choice ``i`` gets the seed the
offline ``LLM`` would give it), all routed to one instance; their delta streams are merged.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence

from pydantic import ValidationError

from conflux_cluster.engine.sampling import mix_seed
from conflux_cluster.actors.streams import GenerateRequest, Sampling, TokenDelta

from .errors import APIError, bad_request, from_validation_error, model_not_found
from .protocol import (ChatChoice, ChatChoiceMessage, ChatChunkChoice, ChatCompletionChunk,
                       ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs, CompletionChoice,
                       CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                       SamplingFields, UsageInfo, new_id, now)


class Backend(Protocol):
    """Where engine requests run: picks an instance and streams its deltas."""

    async def generate(self, requests: Sequence[GenerateRequest]) -> Sequence[AsyncIterator[TokenDelta]]:
        """Route the requests (together, to one instance) and return one delta stream per request."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def chat_prompt_ids(self, conversation: list[dict[str, str]]) -> list[int]: ...


@dataclass
class _Choice:
    """Accumulated output of one choice."""

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


def parse_body(raw: bytes, model_cls: type[SamplingFields]) -> SamplingFields:
    """Bytes -> validated request, or an APIError(400) naming the bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


class OpenAIServing:
    """The OpenAI endpoints' logic over one served model."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, max_model_len: int, backend: Backend) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.backend = backend

    # ---- request -> engine requests ----------------------------------------------------------

    def _check_model(self, req: SamplingFields) -> None:
        if req.model != self.model_name:
            raise model_not_found(req.model, self.model_name)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        conv = [{"role": m.role, "content": m.text()} for m in req.messages]
        return self.tokenizer.chat_prompt_ids(conv)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            return list(p)
        text = p[0] if isinstance(p, list) and p else p
        if not isinstance(text, str) or not text:
            raise bad_request("prompt: must not be empty", param="prompt")
        return self.tokenizer.encode(text)

    def engine_requests(self, req: SamplingFields, prompt: list[int], max_new: int | None,
                        logprobs: bool, prefix: str, arrival: float) -> list[GenerateRequest]:
        """Validate lengths against the context and build the n engine requests (``arrival``:
        time.time() when the request reached the ingress, before tokenization; TTFT counts from it)."""
        room = self.max_model_len - len(prompt)
        if room <= 0 or (max_new is not None and max_new > room):
            asked = f" + {max_new} output tokens" if max_new is not None else ""
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{len(prompt)} prompt tokens{asked}. Shorten the prompt or lower max_tokens.",
                param="max_tokens" if room > 0 else "messages", code="context_length_exceeded")
        base = new_id(prefix)
        out = []
        for i in range(req.n):
            sampling = Sampling(max_tokens=max_new if max_new is not None else room,
                                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                seed=choice_seed(req.seed, i, req.n), logprobs=logprobs,
                                stop=tuple(req.stop_list()), ignore_eos=req.ignore_eos)
            out.append(GenerateRequest(f"{base}-{i}", prompt, sampling, arrival=arrival))
        return out

    def prepare_chat(self, req: ChatCompletionRequest) -> list[GenerateRequest]:
        arrival = time.time()
        self._check_model(req)
        return self.engine_requests(req, self.chat_prompt(req), req.max_new_tokens(), req.logprobs, "chatcmpl",
                                    arrival)

    def prepare_completion(self, req: CompletionRequest) -> list[GenerateRequest]:
        arrival = time.time()
        self._check_model(req)
        return self.engine_requests(req, self.completion_prompt(req), req.max_new_tokens(),
                                    req.logprobs is not None, "cmpl", arrival)

    # ---- merged delta streams ----------------------------------------------------------------

    async def merged(self, requests: list[GenerateRequest]) -> AsyncIterator[tuple[int, TokenDelta]]:
        """(choice index, delta) from all choices, in arrival order; cancels all on exit."""
        streams = await self.backend.generate(requests)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[TokenDelta]) -> None:
            try:
                async for delta in stream:
                    await queue.put((i, delta, None))
            except APIError as e:
                await queue.put((i, None, e))
            except ValueError as e:  # the engine rejected the request (Ray wraps it; keep the cause)
                cause = getattr(e, "cause", None) or e
                await queue.put((i, None, bad_request(str(cause).strip().splitlines()[-1])))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, None, e))
            await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            done = 0
            while done < len(tasks):
                i, delta, err = await queue.get()
                if err is not None:
                    raise err
                if delta is None:
                    done += 1
                    continue
                yield i, delta
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, requests: list[GenerateRequest]) -> list[_Choice]:
        choices = [_Choice(token_ids=[], logprobs=[]) for _ in requests]
        async for i, d in self.merged(requests):
            c = choices[i]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            c.prompt_tokens, c.output_tokens = d.num_prompt_tokens, d.num_output_tokens
            if d.finished:
                c.finish_reason = d.finish_reason
        return choices

    @staticmethod
    def usage(choices: Sequence[_Choice], prompt_tokens: int) -> UsageInfo:
        completion = sum(c.output_tokens for c in choices)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion)

    # ---- chat --------------------------------------------------------------------------------

    def _chat_logprobs(self, ids: Sequence[int], lps: Sequence[float]) -> ChoiceLogprobs:
        return ChoiceLogprobs(content=[{"token": self.tokenizer.decode([t]), "logprob": lp,
                                        "bytes": None, "top_logprobs": []} for t, lp in zip(ids, lps)])

    async def chat(self, req: ChatCompletionRequest, requests: list[GenerateRequest]) -> ChatCompletionResponse:
        choices = await self.collect(requests)
        out = [ChatChoice(index=i, message=ChatChoiceMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=self._chat_logprobs(c.token_ids, c.logprobs) if req.logprobs else None)
               for i, c in enumerate(choices)]
        return ChatCompletionResponse(id=response_id(requests), created=now(),
                                      model=self.model_name, choices=out,
                                      usage=self.usage(choices, len(requests[0].prompt_token_ids)))

    async def chat_stream(self, req: ChatCompletionRequest, requests: list[GenerateRequest]) -> AsyncIterator[str]:
        """SSE ``data:`` lines: a role chunk per choice, content chunks, optional usage, ``[DONE]``."""
        rid, created = response_id(requests), now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)
            data = c.model_dump(exclude=None if include_usage else {"usage"})
            for ch in data["choices"]:  # like OpenAI/vLLM: delta carries only what changed
                ch["delta"] = {k: v for k, v in ch["delta"].items() if v is not None}
            return sse(json.dumps(data))

        for i in range(len(requests)):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        finals = [_Choice() for _ in requests]
        try:
            async for i, d in self.merged(requests):
                finals[i].output_tokens = d.num_output_tokens
                lp = self._chat_logprobs(d.token_ids, d.logprobs) if req.logprobs else None
                ids = list(d.token_ids) if req.return_token_ids else None
                if d.text or d.finished or lp or ids:
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=d.text or None),
                                                 logprobs=lp, finish_reason=d.finish_reason if d.finished else None,
                                                 token_ids=ids)])
        except APIError as e:
            yield sse(json.dumps(e.body()))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band, then end it
            yield sse(json.dumps(APIError(500, f"internal error: {e}", "internal_error").body()))
        if include_usage:
            yield chunk([], self.usage(finals, len(requests[0].prompt_token_ids)))
        yield "data: [DONE]\n\n"

    # ---- completions -------------------------------------------------------------------------

    def _completion_logprobs(self, ids: Sequence[int], lps: Sequence[float], offset: int) -> CompletionLogprobs:
        toks = [self.tokenizer.decode([t]) for t in ids]
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return CompletionLogprobs(tokens=toks, token_logprobs=list(lps), top_logprobs=None, text_offset=offsets)

    async def completion(self, req: CompletionRequest, requests: list[GenerateRequest]) -> CompletionResponse:
        choices = await self.collect(requests)
        want_lp = req.logprobs is not None
        out = [CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                logprobs=self._completion_logprobs(c.token_ids, c.logprobs, 0) if want_lp else None,
                                token_ids=c.token_ids if req.return_token_ids else None)
               for i, c in enumerate(choices)]
        return CompletionResponse(id=response_id(requests), created=now(),
                                  model=self.model_name, choices=out,
                                  usage=self.usage(choices, len(requests[0].prompt_token_ids)))

    async def completion_stream(self, req: CompletionRequest, requests: list[GenerateRequest]) -> AsyncIterator[str]:
        rid, created = response_id(requests), now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        finals = [_Choice() for _ in requests]
        try:
            async for i, d in self.merged(requests):
                f = finals[i]
                lp = self._completion_logprobs(d.token_ids, d.logprobs, len(f.text)) if req.logprobs is not None else None
                f.text += d.text
                f.output_tokens = d.num_output_tokens
                ids = list(d.token_ids) if req.return_token_ids else None
                if d.text or d.finished or ids:  # with token ids: every token, even one without text
                    c = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[
                        CompletionChoice(index=i, text=d.text, logprobs=lp, token_ids=ids,
                                         finish_reason=d.finish_reason if d.finished else None)])
                    yield sse(c.model_dump_json(exclude={"usage"} if not include_usage else None))
        except APIError as e:
            yield sse(json.dumps(e.body()))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band, then end it
            yield sse(json.dumps(APIError(500, f"internal error: {e}", "internal_error").body()))
        if include_usage:
            c = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                   usage=self.usage(finals, len(requests[0].prompt_token_ids)))
            yield sse(c.model_dump_json())
        yield "data: [DONE]\n\n"


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
