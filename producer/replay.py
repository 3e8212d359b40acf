"""Turns a job's raw event log into what a reader should see.

A `restart` event means the job is being rerun from scratch (worker crash, Redis reconnect). Most
reruns are greedy or seeded, so they regenerate the text already shown; repeating it would corrupt a
terminal that printed it. `Replay` therefore swallows re-sent text that matches what was shown and
passes on only the new part. Only when a rerun diverges does the reader get a RestartEvent (its
`.text` is empty), followed by the rerun's full text so far.
"""
from __future__ import annotations

from typing import Union

from genpool.schemas import ErrorEvent, RestartEvent, ResultEvent, TokenEvent

AnyEvent = Union[TokenEvent, RestartEvent, ResultEvent, ErrorEvent]


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
