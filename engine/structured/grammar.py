"""``StructuredOutput`` -> xgrammar ``Grammar`` (tokenizer-free), and the tokenizer description xgrammar
compiles against. Importing this module imports xgrammar (and so torch): the ingress imports it lazily,
only for requests that carry a constraint.

Choices made for small models: JSON is generated without free whitespace (``any_whitespace=False``: the
separators are ``", "`` and ``": "``), since a model left free to emit whitespace can loop on it until
``max_tokens``; ``json_schema`` is strict (no properties or items the schema does not name).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Callable, Sequence

import xgrammar as xgr

from ..tokenizer import ByteTokenizer, HFTokenizer
from .spec import GuideKind, StructuredOutput
from .string_bounds import MAX_REPEAT, bound_strings, bound_tag_schemas

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

_ANY_OBJECT = '{"type": "object"}'
# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; the client gets the rest
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # a regex's / EBNF's {m}, {m,} or {m,n}


def to_grammar(s: StructuredOutput) -> xgr.Grammar:
    """The grammar of ``s``; ValueError with xgrammar's reason when it cannot be built (a bad schema,
    regex or EBNF grammar)."""
    try:
        return _build(s)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from C++
        reason = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise ValueError(f"invalid {s.kind.value}: {reason}") from None


def _build(s: StructuredOutput) -> xgr.Grammar:
    _check_repeats(s)
    if s.kind is GuideKind.JSON_SCHEMA:
        return xgr.Grammar.from_json_schema(_bounded(s.spec, bound_strings), any_whitespace=False,
                                            strict_mode=True)
    if s.kind is GuideKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if s.kind is GuideKind.REGEX:
        return xgr.Grammar.from_regex(s.spec)
    if s.kind is GuideKind.CHOICE:
        options = json.loads(s.spec)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(o) for o in options))
    if s.kind is GuideKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(s.spec)
    return xgr.Grammar.from_structural_tag(_bounded(s.spec, bound_tag_schemas))


def _check_repeats(s: StructuredOutput) -> None:
    """ValueError if a repetition count in ``s``'s regex, EBNF or schema ``pattern`` is past ``MAX_REPEAT``:
    xgrammar reads it as an int32, so ``a{0,4294967298}`` built as ``a{0,2}`` and ``a{0,2147483648}`` built but
    failed to compile on the rank."""
    if s.kind in (GuideKind.REGEX, GuideKind.GRAMMAR):
        texts = [s.spec]
    elif s.kind in (GuideKind.JSON_SCHEMA, GuideKind.STRUCTURAL_TAG):
        try:
            texts = _patterns(json.loads(s.spec))
        except ValueError:  # not JSON: xgrammar refuses it
            return
    else:
        return
    for text in texts:
        for m in _REPEAT.finditer(text):
            for count in filter(None, m.groups()):
                if len(count.lstrip("0")) > 10 or int(count) > MAX_REPEAT:
                    raise ValueError(f"a repetition count in {m.group(0)[:40]} is more than {MAX_REPEAT}, the most "
                                     "the grammar engine reads")


def _patterns(node: Any) -> list[str]:
    """Every regular expression in a JSON Schema (or a structural tag holding schemas): ``pattern`` values and
    ``patternProperties`` names."""
    if isinstance(node, list):
        return [p for item in node for p in _patterns(item)]
    if not isinstance(node, dict):
        return []
    found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        found += list(node["patternProperties"])
    return found + [p for value in node.values() for p in _patterns(value)]


def _bounded(spec: str, rewrite: Callable[[Any], Any]) -> str:
    """``spec`` (JSON) with its length-bounded strings as patterns; text that is not JSON as it is (for
    xgrammar to refuse). Works around xgrammar#800; goes when a release with its fix ships."""
    try:
        return json.dumps(rewrite(json.loads(spec)), ensure_ascii=False)
    except ValueError:
        return spec


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: ``vocab_size`` is the model's (the logits' width, which may pad
    the tokenizer's; the byte tokenizer's description stops at its own ids); ``stop_token_ids`` the
    engine's EOS set (the only tokens that end a grammar, those the description holds)."""
    stops = sorted(set(stop_token_ids))
    if isinstance(tokenizer, HFTokenizer):
        return xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size, stop_token_ids=stops)
    # byte tokenizer: ids 0..255 are bytes, 256 / 257 BOS / EOS; the ids past them decode to nothing and are
    # left out (a model's 128K-id vocabulary would be 128K special tokens, which xgrammar scans linearly at
    # every accepted token): the mask's words past this vocabulary are zero (RankGrammars)
    n = ByteTokenizer.EOS + 1
    vocab = [bytes([i]) for i in range(256)] + [b"", b""]  # BOS, EOS
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=[t for t in stops if t < n])
