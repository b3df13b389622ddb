"""``conflux serve`` flags generated from ServeConfig / SchedulerConfig fields: coverage, help texts,
precedence over the YAML file, errors naming the field, and the engine config they imply. No Ray."""

from __future__ import annotations

import argparse

import pytest

from conflux_cluster.cli import build_parser
from conflux_cluster.commands.serve import config_from_args, summary
from conflux_cluster.config import ServeConfig
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.scheduler.config import SchedulerConfig


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _cfg(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_every_field_has_a_flag_with_help_and_default() -> None:
    actions = {a.dest: a for a in _serve_parser()._actions}
    dests = [f for f in ServeConfig.model_fields if f != "scheduler"]
    dests += [f"scheduler__{f}" for f in SchedulerConfig.model_fields]  # new scheduler fields appear here too
    for dest in dests:
        assert dest in actions, f"no flag for {dest}"
        assert actions[dest].help and "default" in actions[dest].help.lower(), f"{dest}: help without default"
    flags = {s for a in actions.values() for s in a.option_strings}
    for flag in ("--gpu-memory-utilization", "--kv-cache-memory-gb", "--max-num-batched-tokens", "--max-num-seqs",
                 "--policy", "--xp-mode", "--ttft-slo", "--tbt-slo", "--estimator-profile", "--cuda-graphs",
                 "--no-cuda-graphs", "--block-size", "--dtype", "--num-kv-blocks", "--max-model-len"):
        assert flag in flags
    assert "(default: 0.9)" in actions["gpu_memory_utilization"].help


def test_defaults_come_from_the_engine() -> None:
    cfg = _cfg()
    engine = EngineConfig()
    assert (cfg.gpu_memory_utilization, cfg.kv_cache_memory_gb, cfg.block_size, cfg.dtype, cfg.cuda_graphs) == (
        engine.gpu_memory_utilization, engine.kv_cache_memory_gb, engine.block_size, engine.dtype, None)
    assert cfg.scheduler == SchedulerConfig()


def test_flags_override_yaml_field_by_field(tmp_path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("gpu_memory_utilization: 0.5\ncuda_graphs: false\nmax_num_seqs: 32\n"
                 "scheduler:\n  policy: fcfs\n  tbt_slo: 0.2\n")
    from_file = _cfg("--config", str(f))
    assert (from_file.gpu_memory_utilization, from_file.cuda_graphs) == (0.5, False)
    assert (from_file.scheduler.policy, from_file.scheduler.tbt_slo, from_file.scheduler.max_num_seqs) == (
        "fcfs", 0.2, 32)  # flat scheduler keys in YAML go under 'scheduler'
    cfg = _cfg("--config", str(f), "--tbt-slo", "0.1", "--gpu-memory-utilization", "0.7", "--cuda-graphs",
               "--max-num-batched-tokens", "512")
    assert (cfg.gpu_memory_utilization, cfg.cuda_graphs) == (0.7, True)
    s = cfg.scheduler
    assert (s.tbt_slo, s.max_num_batched_tokens, s.policy, s.max_num_seqs) == (0.1, 512, "fcfs", 32)
    assert _cfg("--no-cuda-graphs").cuda_graphs is False


@pytest.mark.parametrize("argv, field", [
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--kv-cache-memory-gb", "-1"], "kv_cache_memory_gb"),
    (["--dtype", "fp8"], "dtype"),
    (["--xp-mode", "loongserve"], "xp_mode"),
    (["--block-size", "0"], "block_size"),
    (["--max-num-seqs", "0"], "scheduler.max_num_seqs"),
    (["--tbt-slo", "fast"], "scheduler.tbt_slo"),
    (["--policy", "edf"], "scheduler.policy"),
    (["--max-step-stretch", "0.5"], "scheduler.max_step_stretch"),
    (["--router-policy", "fastest"], "router_policy"),
    (["--step-log", "/proc/no-such-dir/steps.jsonl"], "step_log"),  # cannot be created
    (["--step-log", "/"], "step_log"),  # a directory
])
def test_bad_values_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _cfg(*argv)


@pytest.mark.parametrize("key", ["", "   ", "sk-local ", " sk-local", "sk-local\n", "sk-\u00e9t\u00e9", "sk\x00"])
def test_an_api_key_no_client_can_send_is_refused(key: str) -> None:
    """``--api-key ""`` (a shell variable left unset) served /v1 without any key; a key with whitespace at an end,
    or outside printable ASCII, could never match an Authorization header, so every request got 401."""
    with pytest.raises(ValueError, match="api_key: "):
        _cfg("--api-key", key)
    assert _cfg("--api-key", "sk-local").api_key == "sk-local"
    assert _cfg("--api-key", "sk local!~").api_key == "sk local!~"  # a space inside is sent as it is


def test_yaml_field_given_twice_is_rejected(tmp_path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("policy: slo\nscheduler:\n  policy: fcfs\n")
    with pytest.raises(ValueError, match="policy"):
        _cfg("--config", str(f))


def test_a_config_that_is_not_a_regular_file_is_refused_not_read(tmp_path) -> None:
    """``--config`` naming a FIFO (or a device such as /dev/zero) was read without end: start-up hung."""
    import os

    fifo = tmp_path / "serve.yaml"
    os.mkfifo(fifo)  # nothing ever writes it: reading it would block for good
    with pytest.raises(ValueError, match="not a regular file"):
        _cfg("--config", str(fifo))


def test_engine_config_plumbs_every_engine_field() -> None:
    from conflux_cluster.config import ENGINE_FIELDS, engine_config

    # fields both configs have, with the same meaning (seed: the router's vs the weights'; model and
    # device are passed explicitly) must all reach the engine
    shared = set(ServeConfig.model_fields) & set(EngineConfig.model_fields) - {"model", "device", "seed"}
    assert shared == set(ENGINE_FIELDS)
    cfg = _cfg("--gpu-memory-utilization", "0.8", "--kv-cache-memory-gb", "4", "--dtype", "float16",
               "--block-size", "32", "--xp-mode", "uniform-sp", "--no-cuda-graphs", "--max-model-len", "4096",
               "--policy", "srpt", "--max-num-seqs", "17")
    e = engine_config(cfg, 2, "cuda")
    assert (e.gpu_memory_utilization, e.kv_cache_memory_gb, e.dtype, e.block_size, e.xp_mode, e.cuda_graphs,
            e.max_model_len, e.num_ranks, e.device) == (0.8, 4.0, "float16", 32, "uniform-sp", False, 4096, 2, "cuda")
    assert (e.scheduler.policy, e.scheduler.max_num_seqs) == ("srpt", 17)
    mc = resolve_model("smollm2-135m-instruct").config  # CPU serving keeps the old 1 GiB pool
    assert engine_config(_cfg(), 2, "cpu").blocks_per_rank(mc) == EngineConfig(
        model="smollm2-135m-instruct", num_ranks=2, kv_cache_memory_gb=1.0).blocks_per_rank(mc)


def test_summary_line() -> None:
    line = summary(_cfg("--gpu-memory-utilization", "0.85", "--policy", "slo", "--tbt-slo", "0.1"))
    assert "\n" not in line
    for part in ("gpu_memory_utilization=0.85", "policy=slo", "tbt_slo=0.1s", "model=smollm2-135m-instruct"):
        assert part in line
