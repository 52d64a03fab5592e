"""One choice's text as its tokens stream in: incremental detokenization and stop strings.

Incremental detokenization follows vLLM's (``detokenize_incrementally``, a prefix offset and a read
offset over the ids): each new token is decoded together with a few tokens before it, and only the
text past what those decoded to is new; text that ends in an incomplete UTF-8 sequence (``U+FFFD``)
waits for the next token. The text of a choice is therefore built from its tokens alone, the same
whether it is streamed or not, and equals ``Tokenizer.decode`` of its ids for byte-level BPE
vocabularies (SmolLM2, Qwen, Llama 3).

Stop strings (``stop``) are matched in the decoded text, token by token: the choice ends at the
token that completes the first match (finish reason ``stop``, ``stop_reason`` the string); its
``token_ids`` end with that token, its text before the match (or through it with
``include_stop_str_in_output``). While a choice streams, the last ``len(longest stop) - 1``
characters are held back, so a stop string is never half-sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specroll.engine.loaders.tokenizer import Tokenizer


@dataclass
class ChoiceText:
    """The tokens, logprobs, versions and text of one choice (module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        stop: stop strings (none: the text is never searched).
        skip_special_tokens: decode without control tokens.
        include_stop_str: keep the matched stop string in the text.
    """

    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    """``stop``, ``length`` or ``abort`` once the choice ended."""
    stop_reason: str | int | None = None
    """The stop string matched (vLLM's ``stop_reason``), if any."""
    sent_text: int = 0
    """Characters of :attr:`text` streamed so far."""
    sent_tokens: int = 0
    """Tokens streamed so far."""
    final_sent: bool = False
    """The event carrying the finish reason was streamed."""
    _prefix: int = 0
    _read: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Take the next tokens of the choice (each with its behavior logprob and policy version);
        after a stop string matched, the rest are dropped."""
        if self.finished:
            return
        if not self.stop:
            self.token_ids += token_ids
            self.logprobs += logprobs
            self.versions += versions
            self.text += self._decode_new()
            return
        for token, logprob, version in zip(token_ids, logprobs, versions, strict=True):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.versions.append(version)
            before = len(self.text)
            self.text += self._decode_new()
            if len(self.text) > before and self._match_stop(before):
                return

    def finish(self, reason: str) -> None:
        """The generator ended the choice (``stop``: an end-of-sequence or stop token; ``length``;
        ``abort``); a stop string that matched first keeps its reason."""
        if not self.finished:
            self.text += self._decode_rest()
            self.finish_reason = reason

    def _decode_new(self) -> str:
        ids = self.token_ids
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
        new_text = decode(ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing printable yet, or an incomplete UTF-8 sequence: wait for the next token
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(ids)
        return delta

    def _decode_rest(self) -> str:
        """At the end: what the last tokens decode to even if incomplete (``U+FFFD`` kept, as vLLM)."""
        ids = self.token_ids
        if self._read >= len(ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
        new_text = decode(ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        self._prefix = self._read = len(ids)
        return new_text[len(prefix_text):]

    def _match_stop(self, before: int) -> bool:
        longest = max(map(len, self.stop))
        start = max(0, before - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, matched = min(hits)
        self.text = self.text[:at + len(matched)] if self.include_stop_str else self.text[:at]
        self.finish_reason, self.stop_reason = "stop", matched
        return True

    def sendable_text(self) -> str:
        """Text not yet streamed that may be sent now (all of it once finished; else without the
        tail a stop string could still start in), marked as sent."""
        end = len(self.text)
        if not self.finished and self.stop:
            end = max(self.sent_text, end - (max(map(len, self.stop)) - 1))
        delta = self.text[self.sent_text:end]
        self.sent_text = end
        return delta

    def has_news(self) -> bool:
        """Whether a streamed event is due: tokens not yet sent, or the end not yet told."""
        return self.sent_tokens < len(self.token_ids) or (self.finished and not self.final_sent)

    def sendable_tokens(self) -> tuple[list[int], list[float], list[int]]:
        """Token ids, logprobs and versions not yet streamed, marked as sent."""
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return self.token_ids[start:], self.logprobs[start:], self.versions[start:]
