"""The offline Python API (vLLM-shaped)::

    from conflux_cluster import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", device="cpu", dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))

All prompts of one call are submitted together and run with continuous batching and chunked prefill.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Sequence

from conflux_cluster.engine.config import EngineConfig, xp_topology
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.contracts.stream import CompletionOutput, RequestOutput, StepOutput
from conflux_cluster.engine.util.seeds import mix_seed
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.runtime.executor import instance_executor

Conversation = list[dict[str, str]]


class LLM:
    """One in-process engine (one rank). Extra keyword arguments are ``EngineConfig`` fields."""

    def __init__(self, model: str = "smollm2-135m-instruct", device: str = "cpu", dtype: str = "auto",
                 max_num_batched_tokens: int | None = None, ranks: int | None = None,
                 mode: str | None = None, **engine_kwargs: Any) -> None:
        if max_num_batched_tokens is not None:
            engine_kwargs["scheduler"] = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens)
        if ranks is not None:  # ranks=N: an XP instance of N logical ranks (N worker processes)
            engine_kwargs["num_ranks"] = ranks
        if mode is not None:  # xp | xp-no-overlap | uniform-sp | uniform-tp | no-cobatch
            engine_kwargs["xp_mode"] = mode
        self.config = xp_topology(EngineConfig(model=model, device=device, dtype=dtype, **engine_kwargs))
        source = resolve_model(self.config.model)
        executor = instance_executor(self.config, source)
        self.engine = EngineCore(self.config, executor, source=source)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def shutdown(self) -> None:
        """Stop worker processes (XP instances), or release one in-process rank's GPU memory."""
        self.engine.executor.shutdown()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. Prompts are strings or token-id lists."""
        items = [(p, None) if isinstance(p, str) else (None, _token_ids(i, p))
                 for i, p in enumerate(_prompt_list(prompts))]
        return self._run([(text, ids if ids is not None else self.tokenizer.encode(text)) for text, ids in items],
                         sampling_params)

    def chat(self, conversations: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template (with the assistant turn opened) and generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        return self._run([(None, self.tokenizer.chat_prompt_ids(list(c))) for c in conversations],
                         sampling_params)

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        """Validate every prompt, then add them all (none if any is refused) and step until all finish."""
        batch = self._plan(prompts, _per_prompt(sampling_params, len(prompts)))
        results: list[RequestOutput] = []
        slots: dict[str, CompletionOutput] = {}
        try:
            for rid, text, ids, subs in batch:
                outs = []
                for j, (sub_id, sub) in enumerate(subs):
                    slots[sub_id] = CompletionOutput(j, "", [], 0.0, [] if sub.logprobs is not None else None,
                                                     [] if sub.logprobs else None, None)
                    self.engine.add_request(GenerateRequest(sub_id, ids, sub))
                    outs.append(slots[sub_id])
                results.append(RequestOutput(rid, text, ids, outs))
        except BaseException:  # e.g. refused by the scheduler at arrival: take back what was added
            self._abort_unfinished(slots)
            while self.engine.has_unfinished():  # the freeing step (only this call's requests are in)
                self.engine.step()
            raise
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    _apply(slots[delta.request_id], delta)
        except BaseException:
            self._abort_unfinished(slots)
            raise
        return results

    def _plan(self, prompts: list[tuple[str | None, list[int]]], per_prompt: list[SamplingParams],
              ) -> list[tuple[str, str | None, list[int], list[tuple[str, SamplingParams]]]]:
        """(request id, text, ids, [(sub-request id, its params)]) per prompt, each checked by the engine
        (ValueError / TypeError naming the request) before any is added."""
        batch = []
        for i, ((text, ids), p) in enumerate(zip(prompts, per_prompt)):
            rid = str(self._counter)
            self._counter += 1
            subs = [(rid, p)] if p.n == 1 else [
                (f"{rid}-{j}", p.model_copy(update={"n": 1, "seed": None if p.seed is None
                                                    else mix_seed(p.seed, j) >> 1})) for j in range(p.n)]
            try:
                for sub_id, sub in subs:
                    self.engine.check_request(sub_id, ids, sub)
            except (ValueError, TypeError) as e:  # name the prompt as the caller knows it
                raise (TypeError if isinstance(e, TypeError) else ValueError)(f"prompts[{i}]: {e}") from e
            batch.append((rid, text, ids, subs))
        return batch

    def _abort_unfinished(self, slots: dict[str, CompletionOutput]) -> None:
        for sub_id, c in slots.items():
            if c.finish_reason is None:
                self.engine.abort(sub_id)


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt; TypeError / ValueError naming ``sampling_params``."""
    params = sampling_params or SamplingParams()
    per_prompt = [params] * num_prompts if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != num_prompts:
        raise ValueError(f"sampling_params: {len(per_prompt)} for {num_prompts} prompts")
    for i, p in enumerate(per_prompt):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}]: expected SamplingParams, got {type(p).__name__}")
    return per_prompt


def _prompt_list(prompts: Any) -> list:
    """``generate``'s prompts as a list (a string or one list of token ids alone is one prompt); TypeError
    naming ``prompts`` for anything else."""
    if isinstance(prompts, str):
        return [prompts]
    items = _items(prompts)
    if items is None:
        raise TypeError(f"prompts: expected a string, a list of strings or a list of token-id lists, "
                        f"got {type(prompts).__name__}")
    return [items] if items and isinstance(items[0], numbers.Number) else items  # one prompt of ids


def _items(value: Any) -> list | None:
    """The elements of a list-like ``value`` (lists, tuples, arrays); None for anything else."""
    if isinstance(value, (bytes, bytearray, dict)):
        return None
    try:
        return list(value)
    except TypeError:  # not iterable
        return None


def _token_ids(index: int, prompt: Any) -> list[int]:
    """``prompts[index]`` as token ids; TypeError naming it for anything but a list-like of integers
    (floats and bools are refused, not truncated)."""
    items = _items(prompt)
    if items is None:
        raise TypeError(f"prompts[{index}]: expected a string or a list of token ids, got {type(prompt).__name__}")
    ids = []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))  # ints and numpy integers; not floats
        except TypeError:
            raise TypeError(f"prompts[{index}]: token ids must be integers, got {t!r} ({type(t).__name__})") from None
    return ids


def _apply(c: CompletionOutput, d: StepOutput) -> None:
    c.text += d.new_text
    c.token_ids += d.new_token_ids
    c.cumulative_logprob += sum(d.new_logprobs)
    if c.logprobs is not None:
        c.logprobs += d.new_logprobs
    if c.top_logprobs is not None:
        c.top_logprobs += d.new_top_logprobs
    if d.finished:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
