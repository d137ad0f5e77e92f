"""A trace's complete events as columns: head id, start, duration and correlation id.

* **Fast path** (Kineto traces, i.e. every torch.profiler / profd / vLLM / SGLang trace): the
  JSON text is scanned with one regular expression per event head (``"ph": "X"`` … ``"dur"``),
  one 512 KiB run at a time; only the ``cat``/``name``/``pid``/``tid`` text of each event is
  kept, interned, and parsed once per distinct value (:class:`Columns`). It checks itself:
  every ``"ph": "X"`` is matched, and one whose fields do not follow the expected layout
  comes back empty, which sends the whole file to the generic path. No event is ever
  silently skipped.
* **Generic path**: the events are parsed with orjson in runs (see :mod:`.jsonscan`), including
  ``B``/``E`` pairs, which Kineto never writes but other tools do.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from itertools import compress, count
from operator import itemgetter
from typing import Any

import numpy as np
import orjson

from profd.analysis.jsonscan import TraceReadError, TraceStream

__all__ = ["MERGED", "Columns", "LayoutMismatch", "scan_fast", "scan_generic"]

MERGED = "a merged trace written by `profd merge` (not a rank's trace)"

# torch >= 2.x: one key per line. The head is matched loosely so that every X event is seen
# (and every B / E event, whose missing tail sends the file to the generic path, which pairs
# them); the optional tail is the layout: the four lines after "ph" (cat, name, pid, tid —
# their text is parsed as JSON later and must hold those keys), then ts and dur
# (one group: one bytes object per event instead of two; see Columns.add_kineto), indented
# with spaces (other whitespace: _FLEXIBLE). A value never contains a raw newline in JSON,
# so "[^\n]*" safely skips one. Quantifiers are possessive ("*+": each run stops at a
# character its class excludes, so nothing is lost; "?+": nothing follows that could make
# the engine undo a group), which saves the regex engine its backtracking bookkeeping.
# After dur, the "args" of a launch or device event (the categories in _LINKED, marked by
# the empty group "linked") are searched for its "correlation" id: it links a kernel to the
# cuda_runtime call that launched it. Other events' args are not searched (a cpu_op's
# recorded shapes would cost five times the scan). An id anywhere else is not missed
# silently: a segment's count of the key must equal the ids captured, else the segment is
# read again with _FLEXIBLE, and failing that the file takes the generic path. Neither
# search takes an id inside a nested object for the event's own (both stop at a brace), nor
# one that is not a whole integer (generic: "5.0" is no id).
_LINKED_VALUE = (
    rb'"(?:kernel|gpu_mem(?:cpy|set)|cuda_(?:runtime|driver|sync)|privateuse1_(?:runtime|driver))"'
)
_LINKED = _LINKED_VALUE + rb"(?=\s*+,)(?P<linked>)"  # the whole value, then the mark
# Kineto's args: the search steps from key to key, comma to comma, up to 15 keys. A key
# follows "{" or "," (and a comma or quote inside a string cannot be followed by an
# unescaped '"correlation"' in valid JSON), and the lookahead on the key stops it there:
# fewer steps than over every string, at about half the cost. Each step runs to the next
# comma whatever lies between (one cheap run), so the text stepped over is captured and
# must hold no brace (Columns.add_kineto): else the id may not be this event's, and the
# segment is read with _FLEXIBLE (so is one where a string in args holds a brace).
_ARGS_KINETO = (
    rb'(?(linked)(?:\n?+ *+,\n?+ *+"args": \{\n?+ *+((?:(?!"correlation")[^,]*+,\n?+ *+){0,15}+)'
    rb'"correlation": (\d++)(?![.eE]))?+)'
)
# The duration ends where a key or the event does: "5e-1" leaves the tail unmatched (the
# generic path reads it), not read as 5.
_DUR_END = rb"(?=\s*+[,}])"
_KINETO = re.compile(  # the linked value is matched whole, quotes included: no lookahead
    rb'"ph"\s*+:\s*+"[XBE]"(?:,\n *+("cat": (?:' + _LINKED_VALUE + rb"(?P<linked>)|)"
    rb"[^\n]*+\n[^\n]*+\n[^\n]*+\n[^,]*+),\n *+"
    rb'"ts": ([0-9.]++,\n *+"dur": [0-9.]++)' + _DUR_END + _ARGS_KINETO + rb")?+"
)
# The classic Kineto layout (torch before 2.13, i.e. the torch of most GPU jobs; vLLM's and
# SGLang's traces): "ph", "cat", "name", "pid" and "tid" on one line, then "ts" and "dur" on
# the next, then "args". The head runs to the end of its line, whose last character must be
# the comma before "ts" (kept in the head text: Columns' head parse drops it). Kineto's own
# span ("cat": "Trace", once a file) writes ts and dur before pid, tid and name: it leaves
# an empty match, which _SPAN then reads (see _with_spans); so does a compact copy of such a
# file read with _FLEXIBLE.
_CLASSIC = re.compile(
    rb'"ph"\s*+:\s*+"[XBE]"(?:, ("cat": (?:' + _LINKED_VALUE + rb"(?P<linked>)|)"
    rb'[^\n]*+)(?<=,)\n *+"ts": ([0-9.]++, "dur": [0-9.]++)' + _DUR_END + _ARGS_KINETO + rb")?+"
)
_SPAN = re.compile(
    rb'"ph"\s*:\s*"X"\s*,\s*("cat"\s*:\s*"Trace")\s*,\s*"ts"\s*:\s*([0-9.]++)\s*,\s*'
    rb'"dur"\s*:\s*([0-9.]++)\s*,\s*("pid"\s*:\s*(?:"[^"\\\n]*+"|-?\d++)\s*,\s*'
    rb'"tid"\s*:\s*(?:"[^"\\\n]*+"|-?\d++))\s*,\s*("name"\s*:\s*"[^"\\\n]*+")'
)
# _FLEXIBLE's search steps over whole strings: roctracer writes kernel names, braces and
# all, into the args of a launch.
_ARGS_CORRELATION = (
    rb'(?(linked)(?:\s*+,\s*+"args"\s*+:\s*+\{(?:[^"{}]++|"(?!correlation")(?:[^"\\]++|\\.)*+")*+'
    rb'"correlation"\s*+:\s*+(\d++)(?![.eE]))?)'
)
_STR = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_NUM = rb"-?[0-9][0-9.eE+\-]*"
# Any whitespace, same key order (older Kineto, compact writers, profd merge output).
_FLEXIBLE = re.compile(
    rb'"ph"\s*:\s*"[XBE]"(?:\s*,\s*("cat"\s*:\s*(?:'
    + _LINKED
    + rb"|"
    + _STR
    + rb')\s*,\s*"name"\s*:\s*'
    + _STR
    + rb'\s*,\s*"pid"\s*:\s*(?:'
    + _STR
    + rb"|-?\d+)"
    + rb'\s*,\s*"tid"\s*:\s*(?:'
    + _STR
    + rb'|-?\d+))\s*,\s*"ts"\s*:\s*('
    + _NUM
    + rb')\s*,\s*"dur"\s*:\s*('
    + _NUM
    + rb")"
    + _ARGS_CORRELATION
    + rb")?"
)
_CORRELATION_KEY = b'"correlation"'
# findall's groups. _KINETO: head text, the "linked" mark, "ts … dur" text, the args text
# before the correlation id, the id; _FLEXIBLE: head text, the mark, ts, dur, correlation id.
_G, _NUMS, _BEFORE_ID, _KCORR = itemgetter(0), itemgetter(2), itemgetter(3), itemgetter(4)
_TS, _DUR, _CORR = itemgetter(2), itemgetter(3), itemgetter(4)
_NOT_NUMBERS = b'"dur:'  # the characters of a "ts … dur" text that are not the numbers'


class LayoutMismatch(Exception):
    """The fast path cannot vouch for this file: read it with the generic path."""


class Columns:
    """Per-event columns of one file: head id (into ``ids``, whose keys are the heads in
    order of first sight), start, duration and correlation id (-1: none)."""

    def __init__(self) -> None:
        self.ids: defaultdict[Any, int] = defaultdict(count().__next__)
        self.gid: list[np.ndarray] = []
        self.ts: list[np.ndarray] = []
        self.dur: list[np.ndarray] = []
        self.corr: list[np.ndarray] = []

    def add(
        self, keys: Iterable[Any], ts: Iterable[Any], dur: Iterable[Any], corr: np.ndarray, n: int
    ) -> None:
        """Append ``n`` events; ``ValueError`` (nothing appended) if a number does not parse."""
        d = np.fromiter(map(float, dur), np.float64, n)
        t = np.fromiter(map(float, ts), np.float64, n)
        self._append(keys, t, d, corr, n)

    def _append(
        self, keys: Iterable[Any], t: np.ndarray, d: np.ndarray, corr: np.ndarray, n: int
    ) -> None:
        self.gid.append(np.fromiter(map(self.ids.__getitem__, keys), np.int64, n))
        self.ts.append(t)
        self.dur.append(d)
        self.corr.append(corr)

    def add_found(self, found: list[tuple[bytes, ...]], correlation_keys: int) -> None:
        """Append the _FLEXIBLE matches of one segment; ``ValueError`` (nothing appended) if a
        number does not parse or the segment holds a correlation id no match captured."""
        corr = _correlations(found, _CORR, correlation_keys)
        self.add(map(_G, found), map(_TS, found), map(_DUR, found), corr, len(found))

    def add_kineto(self, found: list[tuple[bytes, ...]], correlation_keys: int) -> None:
        """Append the _KINETO matches of one segment, as :meth:`add_found` does.

        ``ValueError`` also when an id was found past a brace (see _ARGS_KINETO). All the
        numbers of the segment are parsed in one orjson call: the ``"ts … dur"``
        texts joined by commas, the ``"dur":`` keys taken out, make one JSON array (about 4x
        faster than ``float()`` per number, and the same values: both round correctly). A
        text orjson refuses (an event whose tail did not match leaves an empty one; "1." is
        no JSON number) is read as before, one ``float()`` per number.
        """
        n = len(found)
        corr = _correlations(found, _KCORR, correlation_keys)
        if correlation_keys:
            before = b"".join(map(_BEFORE_ID, found))
            if b"{" in before or b"}" in before:
                raise ValueError("an id past a brace: maybe not in this event's args")
        nums = list(map(_NUMS, found))
        try:
            flat = orjson.loads(b"[%b]" % b",".join(nums).translate(None, _NOT_NUMBERS))
            if len(flat) != 2 * n:
                raise ValueError("not one start and one duration per event")
            both = np.fromiter(flat, np.float64, 2 * n)
            t, d = both[0::2], both[1::2]
        except (orjson.JSONDecodeError, ValueError, TypeError):
            d = np.fromiter((float(x.rpartition(b" ")[2]) for x in nums), np.float64, n)
            t = np.fromiter((float(x.partition(b",")[0]) for x in nums), np.float64, n)
        self._append(map(_G, found), t, d, corr, n)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if not self.gid:
            empty = np.zeros(0)
            return np.zeros(0, np.int64), empty, empty, np.zeros(0, np.int64)
        return (
            np.concatenate(self.gid),
            np.concatenate(self.ts),
            np.concatenate(self.dur),
            np.concatenate(self.corr),
        )


def _correlations(
    found: list[tuple[bytes, ...]], group: itemgetter, correlation_keys: int
) -> np.ndarray:
    """The ids captured in ``group`` (``b""``: none) as int64, -1 for none; ``ValueError``
    if the segment holds more ``"correlation"`` keys than were captured."""
    corr = np.full(len(found), -1, np.int64)
    if not correlation_keys:  # none in the text: none captured either (CPU-only traces)
        return corr
    raw = list(map(group, found))
    has = np.fromiter(map(len, raw), np.int64, len(raw)) > 0
    if int(has.sum()) != correlation_keys:
        raise ValueError("a correlation id outside the expected place")
    corr[has] = _int64(list(compress(raw, has)))
    return corr


def _int64(ids: list[bytes]) -> np.ndarray:
    """Digit strings as int64, in one orjson call where it reads them (not "007")."""
    try:
        return np.fromiter(orjson.loads(b"[%b]" % b",".join(ids)), np.int64, len(ids))
    except (orjson.JSONDecodeError, ValueError, OverflowError):
        return np.array(ids).astype(np.int64)


def scan_fast(stream: TraceStream) -> tuple[Columns, list[tuple[Any, ...]]]:
    """The regex path; ``LayoutMismatch`` where it cannot vouch for the result."""
    cols = Columns()
    pattern: re.Pattern[bytes] | None = None  # the file's layout, from its first X event
    for run in stream.raw_runs():  # pieces (text, start, end) of one run of events
        if b'"profdMerge"' in stream.prefix:  # written first by profd merge: skip it early
            raise TraceReadError(stream.path, MERGED)
        if not stream.prefix.lstrip()[:1] == b"{" or b'"schemaVersion"' not in stream.prefix:
            raise LayoutMismatch("not a Kineto trace")
        pattern = pattern or _layout(run)
        found = _findall(pattern or _KINETO, run)
        if not found:
            continue
        keys = sum(text.count(_CORRELATION_KEY, start, end) for text, start, end in run)
        try:  # an event whose tail did not match has empty fields: float(b"") fails
            _add(cols, found, keys, run, pattern or _KINETO)
            continue
        except ValueError:
            if pattern is _FLEXIBLE:
                raise LayoutMismatch("an event does not follow the expected key order") from None
        pattern = _FLEXIBLE
        found = _findall(pattern, run)
        try:
            _add(cols, found, keys, run, pattern)
        except ValueError:
            raise LayoutMismatch("an event does not follow the expected key order") from None
    heads: list[tuple[Any, ...]] = []
    for text in cols.ids:  # once per distinct (cat, name, pid, tid) text
        try:
            h = orjson.loads(b"{" + text.rstrip(b",") + b"}")  # classic heads end at ","
            heads.append((h["cat"], h["name"], h["pid"], h["tid"]))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise LayoutMismatch(f"unexpected event fields: {bytes(text[:200])!r}") from None
    return cols, heads


def _layout(run: list[tuple[bytes, int, int]]) -> re.Pattern[bytes] | None:
    """The pattern whose layout the run's first X event has in full (None: the run has none;
    _FLEXIBLE when neither strict layout reads it: a file written on one line, say, where
    the classic pattern would run to the end of the line for every event)."""
    for text, start, end in run:
        at = text.find(b'"ph": "X"', start, end)
        if at < 0:
            continue
        for pattern in (_CLASSIC, _KINETO):
            m = pattern.match(text, at, end)
            if m is not None and m[3]:
                return pattern
        return _FLEXIBLE
    return None


def _add(
    cols: Columns,
    found: list[tuple[bytes, ...]],
    keys: int,
    run: list[tuple[bytes, int, int]],
    pattern: re.Pattern[bytes],
) -> None:
    """The run's matches added by the pattern's kind; one that holds Kineto's span in its
    own key order (which left an empty match) is added with the span read by _SPAN."""
    add = cols.add_found if pattern is _FLEXIBLE else cols.add_kineto
    try:
        add(found, keys)
    except ValueError:
        if pattern is _KINETO:  # torch 2.13 writes the span in the usual order
            raise
        add(_with_spans(found, run, pattern, flexible=pattern is _FLEXIBLE), keys)


def _with_spans(
    found: list[tuple[bytes, ...]],
    run: list[tuple[bytes, int, int]],
    pattern: re.Pattern[bytes],
    flexible: bool,
) -> list[tuple[bytes, ...]]:
    """``found`` with each empty match replaced by the Kineto span (in its own key order)
    that starts exactly there, as the pattern would have captured it; ``ValueError`` when an
    empty match is not such a span."""
    # the matches again, in findall's order, now with their places
    where = [(text, m.start(), b, m[3]) for text, a, b in run for m in pattern.finditer(text, a, b)]
    if len(where) != len(found):
        raise ValueError("the run's matches changed")
    fixed = list(found)
    for i, (text, at, end, tail) in enumerate(where):
        if tail:
            continue
        span = _SPAN.match(text, at, end)  # the empty match must be a span, right there
        if span is None:
            raise ValueError("an event does not follow the expected key order")
        head = span[1] + b", " + span[5] + b", " + span[4]  # cat, name, pid and tid
        if flexible:  # head, mark, ts, dur, id
            fixed[i] = (head, b"", span[2], span[3], b"")
        else:  # head, mark, "ts … dur", text before the id, id
            fixed[i] = (head, b"", span[2] + b', "dur": ' + span[3], b"", b"")
    return fixed


def _findall(pattern: re.Pattern[bytes], run: list[tuple[bytes, int, int]]) -> list[Any]:
    found = pattern.findall(*run[0])
    for piece in run[1:]:
        found += pattern.findall(*piece)
    return found


def scan_generic(stream: TraceStream) -> tuple[Columns, list[tuple[Any, ...]]]:
    """Every event parsed (orjson), ``B``/``E`` pairs joined per thread."""
    cols = Columns()
    open_b: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for events in stream.event_lists():
        keys: list[tuple[Any, ...]] = []
        ts: list[float] = []
        dur: list[float] = []
        corr: list[int] = []
        for e in events:
            if not isinstance(e, dict):
                continue
            ph = e.get("ph")
            if ph == "X":
                keys.append((e.get("cat", ""), e.get("name", ""), e.get("pid"), e.get("tid")))
                ts.append(e.get("ts", 0.0))
                dur.append(e.get("dur", 0.0))
                corr.append(_correlation(e))
            elif ph == "B":
                open_b[(e.get("pid"), e.get("tid"))].append(e)
            elif ph == "E":
                stack = open_b.get((e.get("pid"), e.get("tid")))
                if stack:
                    b = stack.pop()
                    keys.append((b.get("cat", ""), b.get("name", ""), b.get("pid"), b.get("tid")))
                    ts.append(b.get("ts", 0.0))
                    dur.append(float(e.get("ts", 0.0)) - float(b.get("ts", 0.0)))
                    corr.append(_correlation(b))
        if keys:
            cols.add(keys, ts, dur, np.array(corr, np.int64), len(keys))
    return cols, list(cols.ids)


def _correlation(event: dict[str, Any]) -> int:
    """An event's ``args.correlation`` (a launch's or a device event's), -1 without one."""
    args = event.get("args")
    value = args.get("correlation") if isinstance(args, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1
