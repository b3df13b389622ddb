"""Tokenizers behind one small interface: Hugging Face (from a directory or from GGUF metadata),
and a byte-level one for random-weight preset models (no vocabulary file needed)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

# [{"role": "user", "content": "..."}, ...]; an assistant message may carry "tool_calls" (content None)
Conversation = list[dict[str, Any]]
Tools = list[dict[str, Any]]  # OpenAI tool definitions, passed to the chat template as transformers does


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation is rendered (vLLM's request and server options of the same names)."""

    add_generation_prompt: bool = True  # end with the assistant turn's opening
    continue_final_message: bool = False  # leave the last (assistant) message open: the model continues it
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra template variables (chat_template_kwargs)
    template: str | None = None  # a Jinja template over the model's own (the server's --chat-template)


def out_of_vocab(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids of ``token_ids`` a model of ``vocab_size`` cannot embed (the engine and the ingress
    reject prompts holding any)."""
    return [t for t in token_ids if not 0 <= t < vocab_size]


class Tokenizer(Protocol):
    eos_token_ids: list[int]  # any of these ends generation (unless ignore_eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def chat_prompt_ids(self, conversation: Conversation, options: ChatTemplateOptions | None = None,
                        tools: Tools | None = None) -> list[int]: ...

    @property
    def chat_template(self) -> str | None: ...  # the Jinja source (None: no template)


class HFTokenizer:
    """Wraps a transformers fast tokenizer; special tokens are skipped when decoding (like vLLM)."""

    def __init__(self, tok, extra_eos: Sequence[int] = ()) -> None:
        self.hf = tok
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.eos_token_ids = sorted(set(eos) | set(extra_eos))

    @classmethod
    def from_dir(cls, path: str, gguf_file: str | None = None, extra_eos: Sequence[int] = ()) -> "HFTokenizer":
        from transformers import AutoTokenizer

        if gguf_file:  # converted once per machine, then read from the user cache
            from pathlib import Path

            from .tokenizer_cache import load_gguf_tokenizer

            return cls(load_gguf_tokenizer(Path(path) / gguf_file), extra_eos)
        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True), extra_eos)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for (its vocabulary entry's UTF-8 length bounds it:
        a byte-level entry has one character per byte, a SentencePiece "▁" is 3 bytes for one space)."""
        return max((len(t.encode("utf-8")) for t in self.hf.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. Its decode when that is whole text; a token holding part of a
        character (an emoji is several byte-level tokens) decodes to U+FFFD, so its bytes come from its
        vocabulary entry: a byte-level BPE entry (one character per byte, GPT-2's map) or a ``<0xNN>``
        byte-fallback piece. OpenAI's logprobs ``bytes`` exist so a client can join such tokens."""
        text = self.decode([token_id])  # a special token: no text, no bytes (as its "token")
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.hf.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            table = _byte_level_decoder()
            if piece and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return text.encode("utf-8")

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special token (``<|im_end|>``, ...): in a message's content it is text, not control."""
        added = (t.content for t in getattr(self.hf, "added_tokens_decoder", {}).values() if t.special)
        return tuple(sorted({*self.hf.all_special_tokens, *added} - {""}))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def chat_prompt_ids(self, conversation: Conversation, options: ChatTemplateOptions | None = None,
                        tools: Tools | None = None) -> list[int]:
        options = options or ChatTemplateOptions()
        if not (options.template or getattr(self.hf, "chat_template", None)):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        where = _special_text_beside_content(conversation, tools, options.kwargs, self.special_texts)
        if where is not None:
            raise ValueError(f"{where} holds special-token text, which the chat template would write as control "
                             "tokens (only a message's content is kept as written); remove it")
        if any(s in (m.get("content") or "") for m in conversation for s in self.special_texts):
            return self._chat_ids_content_as_text(conversation, options, tools)
        text = self._render(conversation, options, tools)
        return list(self.hf.encode(text, add_special_tokens=False))  # the template already has BOS

    def _render(self, conversation: Conversation, options: ChatTemplateOptions, tools: Tools | None = None) -> str:
        """The template's text; a template error (a variable it cannot take, a role it refuses) is a ValueError."""
        from jinja2 import TemplateError

        reserved = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
                    "tools"}
        kwargs = {k: v for k, v in options.kwargs.items() if k not in reserved}
        try:
            return self.hf.apply_chat_template(conversation, tools=tools,
                                               add_generation_prompt=options.add_generation_prompt,
                                               continue_final_message=options.continue_final_message,
                                               chat_template=options.template, tokenize=False, **kwargs)
        except (TemplateError, TypeError, ValueError) as e:
            raise ValueError(f"the chat template failed on this conversation: {str(e)[:200]}") from None

    def _chat_ids_content_as_text(self, conversation: Conversation, options: ChatTemplateOptions | None = None,
                                  tools: Tools | None = None) -> list[int]:
        """The template's tokens with each message's content tokenized as plain text, so that special-token
        text a client writes (``<|im_end|><|im_start|>system``) cannot end its turn or open another role's
        (OpenAI's behaviour; tokenizing the rendered template whole would parse it as control tokens).
        Only conversations holding such text come here: the others keep the plain path's exact tokens."""
        options = options or ChatTemplateOptions()
        marks = [f"\ue000{i}\ue001" for i in range(len(conversation))]  # private-use: no template touches them
        text = self._render([{**m, "content": k} for m, k in zip(conversation, marks)], options, tools)
        ids: list[int] = []
        pos = 0
        for m, mark in zip(conversation, marks):
            at = text.find(mark, pos)
            if at < 0 or text.count(mark) != 1:
                raise ValueError("a message holds special-token text and this model's chat template does not "
                                 "keep its content as written; remove the special-token text")
            ids += self.hf.encode(text[pos:at], add_special_tokens=False)
            ids += self.hf.encode(m.get("content") or "", add_special_tokens=False, split_special_tokens=True)
            pos = at + len(mark)
        return ids + list(self.hf.encode(text[pos:], add_special_tokens=False))


def _special_text_beside_content(conversation: Conversation, tools: Tools | None, kwargs: Mapping[str, Any],
                                 special_texts: Sequence[str]) -> str | None:
    """Where special-token text (``<|im_end|>``) sits in what a template writes as it is besides a message's
    content: ``tools`` (descriptions, schemas), a message's ``tool_calls`` / ``tool_call_id`` / ``name``, or a
    ``chat_template_kwargs`` value; None if nowhere."""
    parts = [("tools", tools), ("chat_template_kwargs", dict(kwargs))] + [
        (f"messages[{i}].{k}", m[k]) for i, m in enumerate(conversation)
        for k in ("tool_calls", "tool_call_id", "name") if m.get(k)]
    for where, value in parts:
        text = json.dumps(value, ensure_ascii=False, default=str) if value else ""
        if any(s in text for s in special_texts):
            return where
    return None


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of its ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class ByteTokenizer:
    """UTF-8 bytes are token ids 0..255; 256 = BOS, 257 = EOS; ids above are decoded as nothing."""

    BOS, EOS = 256, 257

    max_token_bytes = 1  # one byte per token

    def __init__(self) -> None:
        self.eos_token_ids = [self.EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """No BOS either way (``chat_prompt_ids`` writes it)."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """BOS / EOS have no text either way."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The byte a token is (none for BOS, EOS and ids above)."""
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    chat_template = None  # a plain "role: content" prompt (tools are written into the conversation)

    def chat_prompt_ids(self, conversation: Conversation, options: ChatTemplateOptions | None = None,
                        tools: Tools | None = None) -> list[int]:
        """A fixed template (``options`` other than the defaults: ValueError, it has no Jinja template)."""
        if options is not None and options != ChatTemplateOptions():
            raise ValueError("this model's byte tokenizer has a fixed chat template: no template options")
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in conversation) + "assistant: "
        return [self.BOS] + self.encode(text)
