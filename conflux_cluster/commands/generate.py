"""``conflux generate`` and ``conflux chat``: offline generation with the in-process engine (one rank)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="built-in name, random preset, local HF directory or .gguf file (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<i> (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step (chunk size)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool budget (GiB)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")


def register(subparsers: Any) -> None:
    gen = subparsers.add_parser("generate", help="complete prompts offline (continuous batching, one rank)")
    gen.add_argument("prompts", nargs="*", help="prompts (default: read one prompt per line from stdin)")
    _engine_args(gen)
    gen.set_defaults(func=run_generate)
    chat = subparsers.add_parser("chat", help="chat with the model (applies its chat template)")
    chat.add_argument("-m", "--message", action="append", default=[],
                      help="a user message; several run as one conversation, answered turn by turn; "
                           "without it: an interactive session on stdin")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    chat.set_defaults(func=run_chat)


def _build(args: argparse.Namespace):
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
              num_threads=args.threads)
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
    core.add_request(request_id, prompt_ids, params)
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
