"""What flows between the ingress and an XP instance: typed requests in, token deltas out.

Stop strings are matched here, on the detokenized text, because a match can straddle tokens: a
``StopMatcher`` holds back the tail of the text that could still be the start of a stop string,
so a stream never shows text that a later stop match would have cut::

    text so far: "... Paris.\\nUs"    stop = ["\\nUser"]    -> emit "... Paris."  hold "\\nUs"
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sampling:
    """Sampling of one engine request, as the ingress validated it (engine-independent)."""

    max_tokens: int  # output cap (prompt + this fits the context: checked by the ingress)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None
    logprobs: bool = False  # return the sampled token's logprob
    stop: tuple[str, ...] = ()  # stop strings, excluded from the output (matched by the instance)
    ignore_eos: bool = False  # keep going past EOS (benchmarks: exact output lengths)


@dataclass(frozen=True)
class GenerateRequest:
    """Ingress -> instance: one engine request (a choice of an OpenAI request when n > 1)."""

    request_id: str  # unique over the cluster
    prompt_token_ids: list[int]  # already templated and tokenized by the ingress
    sampling: Sampling
    arrival: float | None = None  # time.time() when the HTTP request arrived


@dataclass(frozen=True)
class TokenDelta:
    """Instance -> ingress: new output of one request since the previous delta."""

    request_id: str
    text: str  # new text (stop-string safe)
    token_ids: tuple[int, ...]  # new token ids
    logprobs: tuple[float, ...] = ()  # logprob of each new token (when asked for)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far


@dataclass
class StopMatcher:
    """Finds the first stop string in a growing text; releases only text that cannot become one."""

    stops: tuple[str, ...]
    _text: str = ""  # everything received
    _sent: int = 0  # characters of _text already released
    stopped: bool = field(default=False)

    def feed(self, new_text: str, final: bool = False) -> str:
        """Add ``new_text``; return what can be released now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        self._text += new_text
        cut = self._first_match()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        if final or not self.stops:
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_tail())

    def _first_match(self) -> int | None:
        start = max(0, self._sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (self._text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self._sent)
        out, self._sent = self._text[self._sent:upto], upto
        return out
