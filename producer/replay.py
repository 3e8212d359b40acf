"""Turns a job's raw event log into what a reader should see.

A `restart` event means the job is being rerun from scratch (worker crash, Redis reconnect). Most
reruns are greedy or seeded, so they regenerate the text already shown; repeating it would corrupt a
terminal that printed it. `Replay` therefore swallows re-sent text that matches what was shown and
passes on only the new part. Only when a rerun diverges does the reader get a RestartEvent (its
`.text` is empty), followed by the rerun's full text so far.

A job's stream is capped (MAXLEN ~16,384 entries), so a reader that falls further behind loses the
oldest events unread. Workers number every entry (field `seq`: 1, 2, ...), and `read_events`
puts a TrimmedEvent where the numbers jump, so such a reader is told, not handed a silent gap.
"""
from __future__ import annotations

from typing import Iterator, Optional, Union

from genpool.schemas import ErrorEvent, RestartEvent, ResultEvent, TokenEvent, TrimmedEvent

from .protocol import decode_event

AnyEvent = Union[TokenEvent, RestartEvent, ResultEvent, ErrorEvent, TrimmedEvent]


class _Track:
    """Text/token ids shown to the reader for one completion index, and the rerun's copy."""

    def __init__(self) -> None:
        self.text, self.ids = "", []
        self.redo_text, self.redo_ids = "", []
        self.replaying = False


class Replay:
    def __init__(self) -> None:
        self.tracks: dict[int, _Track] = {}
        self.restarts = 0

    def feed(self, ev: AnyEvent) -> list[AnyEvent]:
        """Events to hand to the reader for one raw event (possibly none)."""
        if isinstance(ev, RestartEvent):
            self.restarts += 1
            for t in self.tracks.values():
                t.replaying, t.redo_text, t.redo_ids = True, "", []
            return []
        if isinstance(ev, ResultEvent) and any(
                t.replaying and (t.redo_text, t.redo_ids) != (t.text, t.ids)
                for t in self.tracks.values()):
            return self._diverged() + [ev]  # the rerun ended short of what was shown
        if not isinstance(ev, TokenEvent):
            return [ev]
        t = self.tracks.setdefault(ev.index, _Track())
        if not t.replaying:
            t.text += ev.text
            t.ids += ev.token_ids
            return [ev]
        return self._rerun_token(t, ev)

    def _rerun_token(self, t: _Track, ev: TokenEvent) -> list[AnyEvent]:
        t.redo_text += ev.text
        t.redo_ids += ev.token_ids
        if t.text.startswith(t.redo_text) and len(t.redo_ids) <= len(t.ids):
            return []  # still inside what the reader has already seen
        if t.redo_text.startswith(t.text) and t.redo_ids[:len(t.ids)] == t.ids:
            new_ids = t.redo_ids[len(t.ids):]
            out = TokenEvent(index=ev.index, text=t.redo_text[len(t.text):], token_ids=new_ids,
                             logprobs=ev.logprobs[-len(new_ids):] if ev.logprobs and new_ids else None)
            t.text, t.ids, t.replaying = t.redo_text, list(t.redo_ids), False
            return [out]
        return self._diverged()

    def _diverged(self) -> list[AnyEvent]:
        """The rerun differs from what was shown: the reader drops everything, gets the rerun."""
        out: list[AnyEvent] = [RestartEvent(reason="rerun diverged from the text already streamed",
                                            attempt=self.restarts + 1)]
        for index in sorted(self.tracks):
            t = self.tracks[index]
            if t.replaying:
                t.text, t.ids, t.replaying = t.redo_text, list(t.redo_ids), False
            if t.text or t.ids:
                out.append(TokenEvent(index=index, text=t.text, token_ids=list(t.ids)))
        return out


class Gaps:
    """Follows the `seq` numbers of one reader's entries (docs/protocol.md, "Reading a job's
    output"): a jump from k to k + 1 + n means n events were trimmed before it read them."""

    def __init__(self, start: str = "0-0"):
        # read from the start: the first entry must be number 1; from elsewhere, the first
        # entry read sets where counting starts
        self.last: Optional[int] = 0 if start in ("0", "0-0") else None

    def check(self, fields) -> Optional[TrimmedEvent]:
        seq = _seq(fields)
        gap = (TrimmedEvent(events=seq - self.last - 1)
               if seq is not None and self.last is not None and seq > self.last + 1 else None)
        self.last = seq  # an entry without one (a worker before `seq`): nothing to count from
        return gap


def read_events(xread_reply, gaps: Gaps) -> Iterator[tuple[Optional[str], AnyEvent]]:
    """(entry id, event) for every entry of an XREAD reply, with (None, TrimmedEvent) in front
    of an entry whose number says events before it were trimmed unread."""
    for _, entries in xread_reply or []:
        for entry_id, fields in entries:
            gap = gaps.check(fields)
            if gap is not None:
                yield None, gap
            yield entry_id, decode_event(fields)


def _seq(fields) -> Optional[int]:
    if isinstance(fields, list):  # redis-py's cluster MULTI leaves stream replies unparsed
        fields = dict(zip(fields[0::2], fields[1::2]))
    raw = fields.get("seq", fields.get(b"seq"))
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
