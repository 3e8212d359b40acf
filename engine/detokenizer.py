"""Incremental detokenization with stop-string handling.

`IncrementalDetokenizer.add(ids)` returns the text that is safe to show now plus the stop string
that ended the output (or None). Two kinds of text are held back:

* a trailing broken UTF-8 character (byte-level tokens that split one character): decoding such
  a tail ends in U+FFFD, so we wait until it no longer does;
* a suffix that could still grow into a stop string.

Decoding uses the prefix_offset / read_offset technique: only a short window of recent tokens is
decoded each step (`decode(ids[prefix:])` minus `decode(ids[prefix:read])`), so the cost per token
is O(1) in the output length. Offsets only ever sit on clean character boundaries.
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
# prompt tokens decoded as left context for the first output tokens
INITIAL_CONTEXT = 5
# a legit incomplete character spans <= 3 bytes, so a longer wait means invalid bytes
MAX_PENDING = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings count only once this many tokens are out
        self.num_tokens = 0  # output tokens added so far
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # token window: a few prompt tokens (left context) followed by all output tokens
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        if self._decode(0, self._read).endswith(REPLACEMENT):
            self._prefix = self._read  # prompt ends mid-character: decode the output on its own
        self._decoded = ""  # all decoded output text (emitted + held back for stop strings)
        self._held = 0  # its tail held back: the longest suffix that is a proper prefix of a stop
        self.text = ""  # output text emitted so far
        self.stop_reason: str | None = None  # the stop string that ended the output
        self.finished = False

    # ---- decoding ---------------------------------------------------------------------------
    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _advance(self, new_read: int) -> None:
        self._prefix, self._read = self._read, new_read

    def _next_delta(self) -> str:
        """Decode the newest token(s); return the newly completed text (maybe '')."""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        if not new_text.endswith(REPLACEMENT):
            self._advance(len(self._ids))
            return new_text[len(prefix_text):]
        if len(self._ids) - self._read <= MAX_PENDING:
            return ""  # wait for the rest of a split character
        return self._force_delta(prefix_text, new_text)

    def _force_delta(self, prefix_text: str, new_text: str) -> str:
        """Long run of invalid bytes: emit up to the newest boundary no later token can change.

        A split at k is final when decode(a + b) == decode(a) + decode(b) with b non-empty: then no
        character (or invalid sequence) spans k, and bytes after the end cannot make one.
        """
        for k in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._prefix, k)
            if head.startswith(prefix_text) and head + self._decode(k) == new_text:
                self._advance(k)
                return head[len(prefix_text):]
        return ""

    # ---- public API -------------------------------------------------------------------------
    def add(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Feed new output tokens; return (text safe to emit now, matched stop string or None)."""
        if self.finished:
            return "", None
        old_len = len(self._decoded)
        for t in token_ids:
            self._ids.append(int(t))
            self.num_tokens += 1
            self._decoded += self._next_delta()
        return self._emit(old_len)

    def flush(self) -> str:
        """Finish: emit everything held back (a split character, a partial stop string)."""
        if self.finished:
            return ""
        old_len = len(self._decoded)
        self._decoded += self._decode(self._prefix)[len(self._decode(self._prefix, self._read)):]
        self._advance(len(self._ids))
        delta, _ = self._emit(old_len, final=True)
        self.finished = True
        return delta

    def _emit(self, old_len: int, final: bool = False) -> tuple[str, str | None]:
        hit = self._find_stop(old_len) if self.num_tokens >= self.min_tokens else None
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if self.include_stop_str_in_output else pos
            delta = self._decoded[len(self.text):max(end, len(self.text))]
            self._decoded = self._decoded[:end]
            self.text += delta
            self.stop_reason, self.finished = stop, True
            return delta, stop
        if not final:
            self._held = self._held_len(self._held + len(self._decoded) - old_len)
        safe_end = len(self._decoded) if final else len(self._decoded) - self._held
        delta = self._decoded[len(self.text):max(safe_end, len(self.text))]
        self.text += delta
        return delta, None

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string that ends in the text added since old_len."""
        if not self.stop:
            return None
        start = max(0, old_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self._decoded.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held_len(self, limit: int) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string.
        Such a suffix, less the text added since, was one before: it is at most the previous
        held length plus what was added (`limit`), so a step looks at that much of the tail, not
        at the longest stop's length (16 stops of 1,024 characters cost ~1.5 ms a token)."""
        text = self._decoded
        for n in range(min(self._max_stop - 1, len(text), limit), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
