"""The offline Python API (vLLM-shaped)::

    from conflux_cluster import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", device="cpu", dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))

All prompts of one call are submitted together and run with continuous batching and chunked prefill.
"""

from __future__ import annotations

from typing import Any, Sequence

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.outputs import CompletionOutput, RequestOutput, StepOutput
from conflux_cluster.engine.seeds import mix_seed
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.xp.spec import instance_executor, xp_topology

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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text or ids)
        items = [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompts]
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
        params = sampling_params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        results: list[RequestOutput] = []
        slots: dict[str, CompletionOutput] = {}
        for (text, ids), p in zip(prompts, per_prompt):
            rid = str(self._counter)
            self._counter += 1
            outs = []
            for j in range(p.n):
                sub = p if p.n == 1 else p.model_copy(update={"n": 1, "seed": None if p.seed is None
                                                               else mix_seed(p.seed, j) >> 1})
                sub_id = rid if p.n == 1 else f"{rid}-{j}"
                self.engine.add_request(sub_id, ids, sub)
                slots[sub_id] = CompletionOutput(j, "", [], 0.0, [] if p.logprobs is not None else None,
                                                 [] if p.logprobs else None, None)
                outs.append(slots[sub_id])
            results.append(RequestOutput(rid, text, ids, outs))
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    _apply(slots[delta.request_id], delta)
        except BaseException:
            for sub_id, c in slots.items():
                if c.finish_reason is None:
                    self.engine.abort(sub_id)
            raise
        return results


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
