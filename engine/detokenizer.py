"""Incremental detokenization with stop strings.

Text is decoded from a small sliding window of token ids (``prefix_offset .. end``), so each
token costs O(1) and multi-byte UTF-8 characters split over several byte tokens are only
emitted once complete (a window ending in U+FFFD is held back)::

    ids:   ... [prefix_offset ....... read_offset) [new tokens]
                 already-emitted context             decode(prefix..end) - decode(prefix..read)

A window that still ends in U+FFFD when the request finishes (an incomplete or invalid byte
sequence at the very end) is flushed by ``finish``, so the emitted pieces always concatenate to
the decoded output (cut at a stop string) and a stop string inside that tail is still matched.

Stop strings: the text is searched (incrementally) for each stop string; on a match the text is
cut before the stop string and nothing after it is ever emitted. While the text ends with a
proper prefix of some stop string that part is held back, so a stop string's first characters
are never emitted either. With a stop string longer than ``EXACT_HOLD_MAX`` characters the last
``len - 1`` characters are held back instead (vLLM's rule for every stop string): finding the
longest such prefix compares every tail length with it, O(len²) work a token.
"""

from __future__ import annotations

from typing import Sequence

from .tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens used as left context (tokenizers that drop a leading space)
EXACT_HOLD_MAX = 64  # longest stop string whose prefixes are looked for at the text's end (see the docstring)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        """``include_stop``: the matched stop string stays in the text (it is cut after it, not before);
        ``skip_special_tokens``: special tokens' text is left out (the tokenizer's decode option)."""
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = list(stop)
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""  # output text so far (cut at a stop string once matched)
        self.emitted = 0  # characters of ``text`` already returned by ``take``
        self._searched = 0  # text[:_searched] holds no complete stop string
        self.stopped_by: str | None = None

    def add(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if one now appears (the text is cut before it).
        ``match_stop`` False (before ``min_tokens``, as vLLM): the text so far is not searched."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.ids.append(token_id)
        self._advance(final=False)
        if not match_stop:
            self._searched = len(self.text)
            return None
        return self._find_stop()

    def finish(self) -> str | None:
        """The request ends (length / EOS / stop id): flush a held-back U+FFFD tail into the text.

        Returns the stop string if one appears in the flushed text (the text is cut before it)."""
        if self.stopped_by is not None:
            return self.stopped_by
        self._advance(final=True)
        return self._find_stop()

    def _advance(self, final: bool) -> None:
        """Move the window's new text into ``text`` unless it may still be an incomplete character."""
        if self.read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special_tokens:  # the default: every tokenizer's plain decode
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _find_stop(self) -> str | None:
        if not self.stop:
            return None
        start = max(0, self._searched - self.max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self._searched = len(self.text)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        self.stopped_by = best[1]
        return best[1]

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string; with a stop string
        longer than ``EXACT_HOLD_MAX``, the last ``max_stop - 1`` characters (the search would cost O(max_stop²)
        character copies a token, on the engine thread every request of the instance waits for)."""
        if self.max_stop - 1 > EXACT_HOLD_MAX:
            return min(len(self.text), self.max_stop - 1)
        for n in range(min(len(self.text), self.max_stop - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def take(self, finished: bool) -> str:
        """Text that became final since the last call (everything left when ``finished``)."""
        if finished:
            self.finish()
        end = len(self.text) if finished or self.stopped_by else len(self.text) - self._held_back()
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
