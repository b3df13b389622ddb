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
