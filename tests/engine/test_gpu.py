"""CUDA: the same engine code on a GPU (skipped without one). Tolerances: fp32 logits within
1e-3 of transformers on the same GPU (TF32 off); bf16 within 5% of the fp32 logit range."""

from __future__ import annotations

import time
import traceback
import warnings

import pytest
import torch

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.tokenizer import ByteTokenizer
from conflux_cluster.engine.runtime.build import local_worker

from .helpers import hf_tiny_model, save_hf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _engine(path: str, dtype: str, backend: str, device: str = "cuda", overlap: bool = False) -> EngineCore:
    """Prefix caching off: finished requests' full blocks would stay cached, and this test checks that
    every block returns to the pool. Not pipelined unless ``overlap``: the logits test reads the rank's
    latest logits after each step, which a pipelined engine has moved past."""
    cfg = EngineConfig(model=path, device=device, dtype=dtype, block_size=16, num_kv_blocks=64,
                       load_progress=False,
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, enable_prefix_caching=False))
    src = resolve_model(path)
    # "torch": the reference backend; "local": what one-GPU instances run (XP backend, one rank)
    worker = local_worker(cfg, src) if backend == "local" else None
    return EngineCore(cfg, LocalExecutor(cfg, src, worker=worker, overlap=overlap), source=src,
                      tokenizer=ByteTokenizer())


@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("kind", ["qwen3", "llama-rope-scaling"])
def test_cuda_logits_match_transformers(tmp_path, kind, backend):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_tiny_model(kind)
    path = str(save_hf(hf, tmp_path / kind))
    hf = hf.cuda()
    prompts = {"a": list(range(3, 50)), "b": list(range(100, 109))}
    for dtype, tol in (("float32", None), ("bfloat16", 0.05)):
        core = _engine(path, dtype, backend)
        worker = core.executor.worker
        worker.keep_logits = True
        for rid, ids in prompts.items():
            core.add_request(GenerateRequest(rid, ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        got: dict[str, list] = {r: [] for r in prompts}
        toks: dict[str, list] = {r: [] for r in prompts}
        while core.has_unfinished():
            for o in core.step():
                got[o.request_id].append(worker.last_logits[o.request_id])
                toks[o.request_id] += o.new_token_ids
        for rid, ids in prompts.items():
            with torch.no_grad():
                ref = hf(torch.tensor([ids + toks[rid][:-1]], device="cuda")).logits[0, len(ids) - 1:].float().cpu()
            ours = torch.stack(got[rid])
            if tol is None:
                torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
            else:
                assert (ours - ref).abs().max() <= tol * (ref.max() - ref.min())
        worker.check_invariants()
        assert worker.kv.num_free_blocks == worker.kv.num_blocks


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_cuda_launch_ahead_same_tokens(tmp_path, params):
    """One GPU rank launching step k+1 before it reads step k's tokens (decode inputs from the device,
    samples copied to pinned memory behind an event) gives the tokens of one step at a time."""
    path = str(save_hf(hf_tiny_model("qwen3"), tmp_path / "m"))
    prompts = {"a": list(range(3, 50)), "b": list(range(100, 109)), "c": list(range(7, 30))}
    out = {}
    for overlap in (False, True):
        core = _engine(path, "bfloat16", "local", overlap=overlap)
        assert core.pipelined == overlap
        for rid, ids in prompts.items():
            core.add_request(GenerateRequest(rid, ids, params))
        toks: dict[str, list] = {r: [] for r in prompts}
        while core.has_unfinished():
            for o in core.step():
                toks[o.request_id] += o.new_token_ids
        core.executor.worker.check_invariants()
        assert core.executor.worker.kv.num_free_blocks == core.executor.worker.kv.num_blocks
        out[overlap] = toks
    assert out[True] == out[False]
    assert all(len(t) == params.max_tokens for t in out[True].values())


def _warm_pipelined_core(tmp_path) -> EngineCore:
    """A warmed-up pipelined engine on a small bf16 Llama with Llama-3.1-8B's head geometry (head_dim 128,
    GQA), so FlashInfer's paged prefill runs where the machine has it; 64-token steps."""
    import transformers

    from conflux_cluster.engine.runtime.warmup import warm_up

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=4096, tie_word_embeddings=False)
    path = str(save_hf(transformers.LlamaForCausalLM(cfg).eval(), tmp_path / "m"))
    run = EngineConfig(model=path, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=256,
                       load_progress=False, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    src = resolve_model(path)
    core = EngineCore(run, LocalExecutor(run, src, worker=local_worker(run, src), overlap=True), source=src,
                      tokenizer=ByteTokenizer())
    assert core.pipelined and core.launches_ahead
    warm_up(core)
    return core


def test_a_launch_never_waits_for_the_step_before(tmp_path):
    """Every launch runs while the device is still busy with a long kernel queued before it (a stand-in
    for the step launched before): a launch that waits for the device, through a synchronizing call or a
    copy from pageable host memory (which waits for its stream and which torch's sync debug mode does
    not see; FlashInfer's plan makes such copies, hence its side stream), takes as long as that kernel."""
    core = _warm_pipelined_core(tmp_path)
    worker = core.executor.worker
    launch, slow, kinds = worker.launch, [], set()
    probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe[0].record()
    torch.cuda._sleep(50_000_000)
    probe[1].record()
    torch.cuda.synchronize()
    cycles = int(50_000_000 * 200.0 / probe[0].elapsed_time(probe[1]))  # ~200 ms of device time

    def behind_a_busy_device(step_input):
        plan = step_input.plan
        kinds.add(("prefill" if plan.prefill else "") + ("decode" if any(plan.decode) else ""))
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        out = launch(step_input)
        took = time.perf_counter() - t0
        if took > 0.1:
            slow.append(f"step {plan.step} ({len(plan.prefill)} chunks, {sum(map(len, plan.decode))} decodes): "
                        f"launch {1e3 * took:.0f} ms behind a 200 ms kernel")
        return out

    worker.launch = behind_a_busy_device
    device_s, read = [], worker._read
    worker._read = lambda launched: (r := read(launched), device_s.append(r.device_s))[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # several chunks in a step, chunks over histories (a 150-token prompt in 64-token steps), decodes beside
    prompts = {"long": list(range(3, 153)), "a": list(range(10, 22)), "b": list(range(30, 39)),
               "c": list(range(60, 130))}
    for rid, ids in prompts.items():
        core.add_request(GenerateRequest(rid, ids, params))
    while core.has_unfinished():
        core.step()
    worker.launch = launch
    assert {"prefill", "prefilldecode", "decode"} <= kinds
    assert not slow, "\n".join(slow)
    worker._read = read
    # each step's device time starts when its launch begins, after the 200 ms kernel queued before it
    assert device_s and all(s is not None and 0 < s < 0.1 for s in device_s), device_s


def test_cuda_launches_after_warm_up_never_synchronize(tmp_path):
    """Ranks launch step k+1 before they read step k: a launch that synchronizes the stream waits for
    step k, and one that synchronizes late in a prefill step waits for most of that step too, so the
    host cannot run ahead and the decode tokens of step k come back late (served on one H100: decode
    steps before a prefill step ~45 ms late). After ``warm_up`` (kernels validated, graphs captured),
    every launch of chunked prefill over histories, several chunks in a step, decodes (logit_bias and
    min_tokens among them) runs under
    torch's sync debug mode; each synchronizing operation it reports is listed."""
    core = _warm_pipelined_core(tmp_path)
    worker = core.executor.worker
    launch, syncs, steps = worker.launch, [], []

    def watched(step_input):
        steps.append(step_input.plan.step)
        def record(message, *_):  # warnings.showwarning runs where the warning is raised: keep the stack
            if "synchroniz" in str(message):
                where = "".join(traceback.format_stack(limit=8)[:-1])
                syncs.append(f"step {step_input.plan.step}: {message}\n{where}")

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                out = launch(step_input)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out

    worker.launch = watched
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # chunks of 64 over histories, several short prompts in one step, and a 193-token prompt whose last
    # chunk can be one token ahead of other chunks (the kernel then takes the rows through a permutation)
    prompts = {"long": list(range(3, 196)), "a": list(range(10, 22)), "b": list(range(30, 39)),
               "c": list(range(50, 57)), "d": list(range(60, 130)), "e": list(range(100, 165)),
               "f": list(range(20, 40))}
    for rid, ids in prompts.items():
        core.add_request(GenerateRequest(rid, ids, params))
    # logits processors that need no history (a penalty reads the tokens first, on purpose): logit_bias, min_tokens
    core.add_request(GenerateRequest("biased", list(range(70, 90)), params.model_copy(
        update={"logit_bias": {5: 3.0, 7: -100.0}, "min_tokens": 4, "ignore_eos": False})))
    while core.has_unfinished():
        core.step()
    # then prompt logprobs (an eval harness's loglikelihood requests): scored on the device, read with the tokens
    core.add_request(GenerateRequest("scored", list(range(5, 90)), params.model_copy(update={"prompt_logprobs": 2})))
    core.add_request(GenerateRequest("beside", list(range(40, 70)), params))
    scored = []
    while core.has_unfinished():
        scored += [o.prompt_logprobs for o in core.step() if o.request_id == "scored" and o.prompt_logprobs]
    worker.launch = launch
    assert len(scored) == 1 and len(scored[0]) == 85
    assert len(steps) >= 10
    assert not syncs, "\n".join(syncs[:4])
