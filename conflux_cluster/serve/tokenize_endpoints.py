"""``/tokenize``, ``/detokenize`` and ``/version``, shaped as vLLM's::

    POST /tokenize    {"prompt": "..."}  or  {"messages": [...]}  ->  {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [...]}                            ->  {"prompt": "..."}
    GET  /version                                                  ->  {"version": "..."}

``model`` is optional (when given it must be the served one). A chat body is templated exactly as a
chat completion would be (same template options), so ``count`` is that request's prompt size.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any, Callable

from fastapi import FastAPI, Request
from pydantic import Field, StrictBool, ValidationError

from conflux_cluster.engine.tokenizer import out_of_vocab

from .errors import bad_request, from_validation_error, model_not_found
from .handlers import OpenAIServing
from .json_body import read_json, reject_lone_surrogates
from .protocol import ChatCompletionRequest, ChatMessage, Int, _Strict


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True  # the tokenizer's BOS, as a completion's prompt gets it
    return_token_strs: StrictBool = False  # also each token's text


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False  # the template writes its own BOS
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int]


def _parse(raw: bytes, pick: Callable[[dict], type[_Strict]]) -> Any:
    data = read_json(raw)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    data = {k: v for k, v in data.items() if v is not None}  # null: the default
    reject_lone_surrogates(data, raw)
    try:
        return pick(data).model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def tokenize(serving: OpenAIServing, raw: bytes) -> dict:
    req = _parse(raw, lambda d: TokenizeChatRequest if "messages" in d else TokenizeCompletionRequest)
    if req.model is not None and req.model != serving.model_name:
        raise model_not_found(req.model, serving.model_name)
    tok = serving.tokenizer
    if isinstance(req, TokenizeChatRequest):  # the chat completion's own templating (tool calls, names)
        try:
            chat = ChatCompletionRequest(model=serving.model_name, messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         chat_template_kwargs=req.chat_template_kwargs)
        except ValidationError as e:
            raise from_validation_error(e) from None
        ids = serving.chat_prompt(chat)
    else:  # text that cannot fit the context is refused before tokenizing, as a completion's prompt is
        serving.refuse_longer_than_context([req.prompt], "prompt")
        ids = tok.encode(req.prompt) if req.add_special_tokens else tok.encode(req.prompt, add_special_tokens=False)
    strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(serving: OpenAIServing, raw: bytes) -> dict:
    req = _parse(raw, lambda d: DetokenizeRequest)
    if req.model is not None and req.model != serving.model_name:
        raise model_not_found(req.model, serving.model_name)
    bad = out_of_vocab(req.tokens, serving.vocab_size)
    if bad:
        raise bad_request(f"tokens: token ids {bad[:3]} are outside the vocabulary [0, {serving.vocab_size})",
                          param="tokens", code="invalid_token_id")
    return {"prompt": serving.tokenizer.decode(req.tokens)}


def server_version() -> str:
    try:
        return metadata.version("conflux_cluster")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_routes(api: FastAPI, serving: OpenAIServing, check_key: Callable[[str | None], str],
               read: Callable[[Request], Any]) -> None:
    """The three routes on ``api``; ``check_key``: the API-key check of ``/v1``; ``read``: the body reader
    (size limit and body timeout of the other POST routes; it also waits, once, for the instances' effective
    context, so ``max_model_len`` is the served one from the first answer). Tokenizing runs in a worker thread."""

    @api.post("/tokenize")
    async def _tokenize(request: Request) -> dict:
        check_key(request.headers.get("authorization"))
        raw = await read(request)
        return await asyncio.to_thread(tokenize, serving, raw)

    @api.post("/detokenize")
    async def _detokenize(request: Request) -> dict:
        check_key(request.headers.get("authorization"))
        raw = await read(request)
        return await asyncio.to_thread(detokenize, serving, raw)

    @api.get("/version")
    async def _version() -> dict:
        return {"version": server_version()}
