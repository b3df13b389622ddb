"""``conflux generate`` and ``conflux chat``: offline generation with the in-process engine (one rank).

    conflux generate "Once upon a time" --max-tokens 32
    conflux chat -m "What is the capital of France?" --temperature 0.7 --seed 1

Engine, scheduler and sampling flags are generated from ``EngineConfig``, ``SchedulerConfig`` and
``SamplingParams`` (their help and defaults are the fields' own; sampling is greedy here by default).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator

from conflux_cluster.engine.contracts.request import GenerateRequest


ENGINE_FIELDS = ("model", "device", "dtype", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_gb",
                 "num_kv_blocks", "num_threads")  # EngineConfig fields offered as flags
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}  # this command's: greedy, a paragraph


def engine_flags() -> list:
    """The flags of ``generate`` / ``chat``, generated from EngineConfig, SchedulerConfig and SamplingParams
    fields (type, help and default written once, on the models)."""
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.engine.scheduler.config import SchedulerConfig

    from ._fields import field_flags

    return (field_flags(EngineConfig, ENGINE_FIELDS)
            + field_flags(SchedulerConfig, ["max_num_batched_tokens"], section="scheduler")
            + field_flags(SamplingParams, SAMPLING_FIELDS, section="sampling", defaults=SAMPLING_DEFAULTS))


def _engine_args(p: argparse.ArgumentParser) -> None:
    groups = {None: p.add_argument_group("engine (EngineConfig)"),
              "scheduler": p.add_argument_group("scheduler (SchedulerConfig)"),
              "sampling": p.add_argument_group("sampling (SamplingParams)")}
    for f in engine_flags():
        f.add_to(groups[f.section], *(["--threads"] if f.field == "num_threads" else []))


def register(subparsers: Any) -> None:
    from ._formatting import HelpFormatter

    gen = subparsers.add_parser("generate", help="complete prompts offline (continuous batching, one rank)",
                                description=__doc__, formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="*", help="prompts (default: read one prompt per line from stdin)")
    _engine_args(gen)
    gen.set_defaults(func=run_generate)
    chat = subparsers.add_parser("chat", help="chat with the model (applies its chat template)",
                                 description=__doc__, formatter_class=HelpFormatter)
    chat.add_argument("-m", "--message", action="append", default=[],
                      help="a user message; several run as one conversation, answered turn by turn; "
                           "unset: an interactive session on stdin")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    chat.set_defaults(func=run_chat)


def _build(args: argparse.Namespace):
    from pydantic import ValidationError

    from conflux_cluster.config import format_validation_error
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.engine.scheduler.config import SchedulerConfig
    from conflux_cluster.llm import LLM

    from ._fields import collect

    given = collect(engine_flags(), args)
    try:
        params = SamplingParams(**given.get("sampling", {}))
        engine = dict(given.get(None, {}))
        if "scheduler" in given:
            engine["scheduler"] = SchedulerConfig(**given["scheduler"])
        llm = LLM(**engine)
    except ValidationError as e:
        raise ValueError(f"invalid option: {format_validation_error(e)}") from None
    return llm, params


def run_generate(args: argparse.Namespace) -> int:
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompts given (pass them as arguments or one per line on stdin)")
    llm, params = _build(args)
    for i, out in enumerate(llm.generate(prompts, params)):
        c = out.outputs[0]
        print(f"--- [{i}] {out.prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
        print(out.prompt + c.text)
    return 0


def stream(llm, prompt_ids: list[int], params, request_id: str) -> Iterator[str]:
    """Text deltas of one request as the engine produces them."""
    core = llm.engine
    core.add_request(GenerateRequest(request_id, prompt_ids, params))
    try:
        while core.has_unfinished():
            for out in core.step():
                if out.request_id == request_id:
                    yield out.new_text
    finally:
        core.abort(request_id)  # no-op when finished; frees KV if the consumer stopped early


def run_chat(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = not args.message
    messages = iter(args.message) if args.message else _read_turns()
    for turn, message in enumerate(messages):
        history.append({"role": "user", "content": message})
        if not interactive:
            print(f"user: {message}\nassistant: ", end="", flush=True)
        reply = ""
        for piece in stream(llm, llm.tokenizer.chat_prompt_ids(history), params, f"chat-{turn}"):
            reply += piece
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
    return 0


def _read_turns() -> Iterator[str]:
    print("Chat with the model (Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip():
            yield line
