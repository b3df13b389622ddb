"""From an OpenAI request to the engine's ``SamplingParams``: the server's options, the model's
``generation_config.json`` defaults, and the per-choice parameters.

A sampling value comes from, first to last (vLLM's rule with ``--generation-config auto``)::

    the request's field (when the client sent it, non-null) > generation_config.json > built-in default
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from pydantic import ValidationError

from conflux_cluster.engine.loader import ModelSource
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.tokenizer import ChatTemplateOptions

from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, SamplingFields
from .reasoning import ReasoningParser

DEFAULT_MAX_LOGPROBS = 20  # vLLM's max_logprobs


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a model ships in ``generation_config.json`` (None: not set there)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens

    @classmethod
    def from_file(cls, path: Path) -> "GenerationDefaults":
        """The fields of ``path`` this server applies; a file that is not a JSON object: ValueError."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config: cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"generation_config: {path} is not a JSON object")
        data = {**data, "max_tokens": data.get("max_new_tokens")}
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


def generation_defaults(setting: str, source: ModelSource) -> GenerationDefaults:
    """``ServeConfig.generation_config``: ``auto`` reads the model directory's ``generation_config.json`` (GGUF
    files and presets have none), ``vllm`` uses the built-in defaults only, anything else is a folder holding
    a ``generation_config.json``."""
    if setting == "vllm":
        return GenerationDefaults()
    if setting == "auto":
        folder = source.path if source.kind == "hf_dir" else None
        if folder is None or not (folder / "generation_config.json").is_file():
            return GenerationDefaults()
    else:
        folder = Path(setting).expanduser()
    return GenerationDefaults.from_file(folder / "generation_config.json")


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is a Jinja template (holds ``{``), compiled
    once here (ValueError naming chat_template): a template that does not compile would fail every chat request."""
    if value is None:
        return None
    if "{" in value:
        text = value
    else:
        path = Path(value).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"chat_template: {value!r} is neither a readable file ({e.strerror}) nor a Jinja "
                             "template") from None
        except UnicodeDecodeError:
            raise ValueError(f"chat_template: {value!r} is not UTF-8 text") from None
    _compiles(text)
    return text


def _compiles(template: str) -> None:
    """``template`` compiled as ``apply_chat_template`` compiles it (transformers' own Jinja environment and
    extensions, such as ``{% generation %}``), or a ValueError with Jinja's reason and line."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template: {e.message} (line {e.lineno})") from None


@dataclass(frozen=True)
class ServingOptions:
    """What the OpenAI layer applies besides the model (from ``ServeConfig``)."""

    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # most top_logprobs / completions logprobs a request may ask
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json
    chat_template: str | None = None  # Jinja text over the model's own template
    reasoning_parser: ReasoningParser | None = None  # split the output into reasoning_content and content


def template_options(req: ChatCompletionRequest, options: ServingOptions) -> ChatTemplateOptions:
    return ChatTemplateOptions(add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               kwargs=dict(req.chat_template_kwargs or {}), template=options.chat_template)


def _value(req: SamplingFields, name: str, defaults: GenerationDefaults) -> object:
    """The request's value when it set it, else the model's default, else the field's."""
    if name in req.model_fields_set:
        return getattr(req, name)
    given = getattr(defaults, name)
    return getattr(req, name) if given is None else given


def check_logprobs(req: SamplingFields, max_logprobs: int) -> None:
    """Alternatives per token (and per prompt position) at most ``max_logprobs``."""
    asked = (("top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs", req.logprobs_count()),
             ("prompt_logprobs", req.prompt_logprobs))
    for param, count in asked:
        if count is not None and count > max_logprobs:
            raise bad_request(f"{param}: {count} is more than this server's max_logprobs ({max_logprobs})",
                              param=param)


def check_token_ids(req: SamplingFields, vocab_size: int) -> None:
    """``logit_bias`` keys and ``stop_token_ids`` must be in the vocabulary (a 400, not an engine error)."""
    for param, ids in (("logit_bias", list(req.logit_bias_ids())), ("stop_token_ids", req.stop_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"{param}: token ids {bad[:3]} are outside the vocabulary [0, {vocab_size})",
                              param=param, code="invalid_token_id")


def default_max_tokens(req: SamplingFields, asked: int | None, defaults: GenerationDefaults) -> int | None:
    """The request's max_tokens; unset, the model's max_new_tokens (None: the rest of the context)."""
    return asked if asked is not None or defaults.max_tokens is None else defaults.max_tokens


def choice_params(req: SamplingFields, options: ServingOptions, max_tokens: int, seed: int | None,
                  logprobs: int | None) -> SamplingParams:
    """The engine's parameters of one choice, validated here (a 400, not an error mid-stream)."""
    d = options.defaults
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=_value(req, "temperature", d), top_p=_value(req, "top_p", d),
            top_k=_value(req, "top_k", d), min_p=_value(req, "min_p", d), seed=seed, stop=req.stop_list(),
            repetition_penalty=_value(req, "repetition_penalty", d), presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, min_tokens=req.min_tokens, logit_bias=req.logit_bias_ids(),
            stop_token_ids=list(dict.fromkeys(req.stop_token_ids or ())), ignore_eos=req.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            prompt_logprobs=req.prompt_logprobs_count())
    except ValidationError as e:
        raise sampling_error(e) from None
    except ValueError as e:
        raise bad_request(f"invalid sampling parameters: {e}") from None


def sampling_error(err: ValidationError) -> APIError:
    """A 400 for the engine's refusal of a choice's ``SamplingParams`` (``min_tokens`` over ``max_tokens``,
    a ``logit_bias`` value out of range, ``ignore_eos`` with a constraint): the validator's own message,
    ``param`` the field it names, never pydantic's dump of the whole input and its help URL."""
    first = err.errors()[0]
    msg = first["msg"].removeprefix("Value error, ")
    loc = [str(x) for x in first["loc"]]
    word = msg.split(" ", 1)[0].rstrip(":")
    param = loc[0] if loc else word if word in SamplingParams.model_fields else None
    if param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return bad_request(msg, param=param)
