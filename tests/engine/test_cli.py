"""``conflux generate`` / ``conflux chat`` through the real dispatcher, on a tiny random preset."""

from __future__ import annotations

from conflux_cluster.cli import build_parser, main


def test_dispatcher_lists_engine_subcommands():
    help_text = build_parser().format_help()
    assert "generate" in help_text and "chat" in help_text


def test_generate_and_chat_run(capsys):
    assert main(["generate", "--model", "tiny-llama", "--max-tokens", "5", "--ignore-eos", "hello", "world"]) == 0
    out = capsys.readouterr().out
    assert "[0] 'hello' (5 tokens, length)" in out and "[1] 'world'" in out
    assert main(["chat", "--model", "tiny-qwen3", "--max-tokens", "3", "-m", "hi", "-m", "again"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant: ") == 2


def test_bad_model_is_one_line_error(capsys):
    assert main(["generate", "--model", "/nonexistent/model", "x"]) == 2
    err = capsys.readouterr().err
    assert "cannot load model '/nonexistent/model'" in err and "Traceback" not in err


def _subcommands() -> dict:
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_flag_of_every_subcommand_has_help_that_states_its_default():
    """No flag is silent about what happens when it is left out (``conflux <cmd> --help``)."""
    subs = _subcommands()
    assert {"bench", "chat", "generate", "profile", "serve", "simulate"} <= set(subs)
    for name, parser in subs.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            shown = formatter._expand_help(action) if action.help else ""
            flag = f"conflux {name} {action.option_strings[-1]}"
            assert shown.strip(), f"{flag}: no help text"
            assert action.required or "default" in shown.lower() or "unset" in shown.lower(), \
                f"{flag}: help does not state its default: {shown!r}"
        parser.format_help()  # renders (a '%' in a help text would raise here)


def test_generate_flags_come_from_the_models():
    """``generate``/``chat`` flags are the EngineConfig / SchedulerConfig / SamplingParams fields: type, help
    text and default written once; this command's own defaults (greedy, 128 tokens) are what help shows."""
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.sampling_params import SamplingParams

    gen = _subcommands()["generate"]
    actions = {a.dest: a for a in gen._actions}
    assert EngineConfig.model_fields["dtype"].description in actions["dtype"].help
    assert SamplingParams.model_fields["top_p"].description in actions["sampling__top_p"].help
    assert "(default: 0.0)" in actions["sampling__temperature"].help
    assert "(default: 128)" in actions["sampling__max_tokens"].help
    assert "--threads" in actions["num_threads"].option_strings  # the old name still works
    args = gen.parse_args(["--stop", "a", "--stop", "b", "--no-ignore-eos", "--top-k", "5", "x"])
    from conflux_cluster.commands._fields import collect
    from conflux_cluster.commands.generate import engine_flags

    given = collect(engine_flags(), args)
    assert given["sampling"] == {"max_tokens": 128, "temperature": 0.0, "top_k": "5", "stop": ["a", "b"],
                                 "ignore_eos": False}
    assert SamplingParams(**given["sampling"]).top_k == 5 and None not in given  # engine: the fields' defaults


def test_bad_sampling_value_is_one_line_error(capsys):
    assert main(["generate", "--model", "tiny-llama", "--top-p", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conflux generate: error: invalid option: top_p") and "Traceback" not in err


def test_cuda_device_without_cuda_is_one_line_error(capsys, monkeypatch, tmp_path):
    """``--device cuda`` where this process sees no CUDA device: a message naming ``device`` before anything
    is built (no ZeroDivisionError / AssertionError from torch), for the offline commands and ``LLM``."""
    import pytest
    import torch

    from conflux_cluster import LLM
    from conflux_cluster.engine.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    EngineConfig(device="cuda")  # configuring GPU ranks (a CPU-only Ray driver does) is no error
    for argv in (["generate", "--model", "tiny-llama", "--device", "cuda", "x"],
                 ["profile", "--model", "tiny-llama", "--device", "cuda:0", "--out", str(tmp_path / "p.json")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "device: cuda" in err and "no CUDA device is available" in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="device: cuda requested but no CUDA device"):
        LLM(model="tiny-llama", device="cuda", load_progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device: cuda:2 requested but this machine has 2 CUDA device"):
        EngineConfig(device="cuda:2").require_device()
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="cuda:x")


def test_device_is_an_enum_parsed_once() -> None:
    """``device`` arrives as a string (flag, file, argument) and is a ``Device`` from then on; ``cuda:<i>``
    is ``cuda`` with ``device_index`` i; code asks the enum's properties, not the spelling."""
    import pytest
    import torch

    from conflux_cluster.engine.config import Device, EngineConfig

    pinned = EngineConfig(device="cuda:1")
    assert pinned.device is Device.CUDA and pinned.device_index == 1 and pinned.device_name == "cuda:1"
    assert pinned.rank_device(3) == torch.device("cuda", 1) and EngineConfig(device="cuda").rank_device(3) == \
        torch.device("cuda", 3)
    assert EngineConfig.model_validate_json(pinned.model_dump_json()) == pinned
    cpu = EngineConfig(device="cpu")
    assert cpu.device is Device.CPU and cpu.rank_device(1) == torch.device("cpu") and cpu.device_name == "cpu"
    assert cpu.torch_dtype() == torch.float32 and pinned.torch_dtype() == torch.bfloat16
    assert not cpu.cuda_graphs_enabled() and pinned.cuda_graphs_enabled()
    assert (Device.CPU.collective_backend, Device.CUDA.collective_backend) == ("gloo", "nccl")
    assert Device.CPU.rank_bundle(0.5) == {"CPU": 0.5} and Device.CUDA.rank_bundle(0.5) == {"CPU": 1.0, "GPU": 1.0}
    for bad in ("auto", "cpu:0", "gpu"):
        with pytest.raises(ValueError, match="device must be"):
            EngineConfig(device=bad)
    with pytest.raises(ValueError, match="device_index"):
        EngineConfig(device="cpu", device_index=0)
