"""Stop strings: cut generated text at the first stop and hold back what may begin one.

A request names its own stop strings; the chat template may add more. The
matcher sees the detokenized text chunk by chunk and releases only text that
can no longer be part of a stop. The result does not depend on how the text
was chunked:

* the match that **starts earliest** wins;
* at the same start, a request stop wins over a template stop, and then the
  shorter stop (it completes first);
* a complete match is not acted on while an earlier-ranked stop could still
  complete (a request stop that begins where a template stop matched waits for
  the text that decides it);
* the matched stop string and everything after it are never emitted, and after
  a match nothing more is.
"""

from __future__ import annotations

from typing import Iterable

import attrs

REQUEST, TEMPLATE = 0, 1  # precedence classes: lower wins at the same position


@attrs.frozen
class _Stop:
    text: str
    kind: int


class StopMatcher:
    """Finds stop strings in streamed text.

    :param request_stops: the request's ``stop`` strings.
    :param template_stops: stop strings the chat template adds; a request stop at
        the same position wins.
    """

    def __init__(self, request_stops: Iterable[str], template_stops: Iterable[str] = ()) -> None:
        seen: set[str] = set()
        stops: list[_Stop] = []
        for kind, texts in ((REQUEST, request_stops), (TEMPLATE, template_stops)):
            for text in texts:
                if text and text not in seen:  # a string in both lists counts as a request stop
                    seen.add(text)
                    stops.append(_Stop(text, kind))
        self._stops = tuple(stops)
        self._held = ""
        self._matched: _Stop | None = None
        self._done = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return None if self._matched is None else self._matched.text

    @property
    def matched_request_stop(self) -> bool:
        """Whether the matched stop came from the request (not the template)."""
        return self._matched is not None and self._matched.kind == REQUEST

    @property
    def held(self) -> str:
        """Text held back because it may begin a stop."""
        return self._held

    def push(self, text: str) -> tuple[str, str | None]:
        """Add generated text.

        :returns: ``(emit, matched)``: the text now safe to emit, and the stop
            string if this text completed the winning stop (then ``emit`` ends just
            before it and every later push returns ``("", None)``).
        """
        if self._done:
            return "", None
        buffer = self._held + text
        if not self._stops:
            self._held = ""
            return buffer, None
        match = self._best_match(buffer)
        partial = self._earliest_partial(buffer, before=match)
        if match is not None and partial is None:
            start, stop = match
            self._finish(stop)
            return buffer[:start], stop.text
        cut = len(buffer) if partial is None else partial[0]
        if match is not None:
            cut = min(cut, match[0])
        self._held = buffer[cut:]
        return buffer[:cut], None

    def flush(self) -> str:
        """End of generation: release the held text.

        A complete stop that was waiting on a better-ranked one that can now never
        complete is taken: the text before it is returned and :attr:`matched` says
        which stop ended the text.
        """
        if self._done:
            return ""
        buffer, self._held = self._held, ""
        match = self._best_match(buffer)
        if match is not None:
            start, stop = match
            self._finish(stop)
            return buffer[:start]
        self._done = True
        return buffer

    def _finish(self, stop: _Stop) -> None:
        self._matched = stop
        self._held = ""
        self._done = True

    def _best_match(self, buffer: str) -> tuple[int, _Stop] | None:
        """The winning complete occurrence: earliest start, then request, then shortest."""
        best: tuple[int, int, int, _Stop] | None = None
        for stop in self._stops:
            start = buffer.find(stop.text)
            if start < 0:
                continue
            key = (start, stop.kind, len(stop.text), stop)
            if best is None or key[:3] < best[:3]:
                best = key
        return None if best is None else (best[0], best[3])

    def _earliest_partial(self, buffer: str, before: tuple[int, _Stop] | None) -> tuple[int, _Stop] | None:
        """The earliest-starting incomplete stop: a suffix of ``buffer`` that begins a stop.

        With ``before`` (a complete match), only partials that would outrank it count:
        those starting earlier, or at the same place with a better precedence class.
        """
        best: tuple[int, _Stop] | None = None
        for stop in self._stops:
            lowest = max(0, len(buffer) - len(stop.text) + 1)
            for start in range(lowest, len(buffer)):
                if stop.text.startswith(buffer[start:]):
                    if before is not None and (start, stop.kind) >= (before[0], before[1].kind):
                        break
                    if best is None or start < best[0]:
                        best = (start, stop)
                    break
        return best
