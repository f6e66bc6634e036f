"""Rows in lockstep: a simulated world's local ranks, each in a thread of its own, taking turns, so a collective inside
a forward or backward (an expert-parallel layer's all-to-all) can wait for every row. One row runs at a time, in row
order; a row that reaches :meth:`Lockstep.meet` parks there and hands the turn to the next; the last to arrive runs
the collective for all of them, and they go on from it, again in row order. Without a meeting the rows run one after
another, as a plain loop over them: the same order, the same bits.

What one thread leaves in process-wide state (the default generator, a module's bound tensors) is the caller's to keep
and put back: ``park(row)`` runs as a row comes to a meeting, ``resume(row)`` when it takes the turn again after it.

Imports: none of fzero.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Lockstep", "LockstepError", "current"]

_local = threading.local()


class LockstepError(RuntimeError):
    """The rows did not meet alike: one reached a meeting the others never reached (or reached another)."""


def current() -> tuple[Lockstep, int] | None:
    """``(the lockstep, this thread's row)`` inside :meth:`Lockstep.run`, else None."""
    return getattr(_local, "where", None)


class Lockstep:
    """Runs ``body(row)`` for ``rows`` rows in turns (module doc). ``park(row)``: called as a row comes to a meeting,
    holding the turn; ``resume(row)``: when it takes the turn back after the meeting, before its code goes on."""

    def __init__(self, rows: int, park: Callable[[int], None] | None = None,
                 resume: Callable[[int], None] | None = None):
        self.rows = rows
        self.park, self.resume = park or (lambda row: None), resume or (lambda row: None)
        self._cv = threading.Condition()
        self._turn = 0
        self._done = [False] * rows
        self._error: BaseException | None = None
        self._waiting: dict[int, tuple[str, Any]] = {}  # row -> (what, value) at the meeting under way
        self._results: dict[int, Any] = {}
        self._round = 0

    def run(self, body: Callable[[int], Any]) -> list[Any]:
        """Every row's ``body(row)``, in row order; the first exception any row raised, raised here."""
        out: list[Any] = [None] * self.rows
        threads = [threading.Thread(target=self._row, args=(r, body, out), name=f"fzero-row-{r}", daemon=True)
                   for r in range(self.rows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._error is not None:
            raise self._error
        return out

    def meet(self, row: int, what: str, value: Any, combine: Callable[[Sequence[Any]], Sequence[Any]]) -> Any:
        """Park ``row`` with ``value`` until every row has come to this meeting (``what`` names it); the last runs
        ``combine(values in row order)`` and each row gets its element. ``LockstepError`` if a row meets another
        ``what``, or ended without coming."""
        self.park(row)
        with self._cv:
            self._check(row, what)
            self._waiting[row] = (what, value)
            round_ = self._round
            if len(self._waiting) == self.rows:
                values = [self._waiting[r][1] for r in range(self.rows)]
                try:
                    results = list(combine(values))
                except BaseException as e:  # noqa: BLE001 - every row raises it
                    self._fail(e)
                    raise
                self._results = dict(enumerate(results))
                self._waiting.clear()
                self._round += 1
                self._turn = 0
                self._cv.notify_all()
            else:
                self._pass_turn(row)
            while not (self._error is not None or (self._round > round_ and self._turn == row)):
                self._cv.wait()
            if self._error is not None:
                raise LockstepError(f"row {row}: another row failed") from self._error
            result = self._results.pop(row)
        self.resume(row)
        return result

    def _check(self, row: int, what: str) -> None:
        for other, (theirs, _) in self._waiting.items():
            if theirs != what:
                self._fail(LockstepError(f"rows met differently: row {other} at {theirs}, row {row} at {what}: every "
                                         "rank must run the same collectives in its forward and backward"))
                raise self._error  # type: ignore[misc]

    def _pass_turn(self, row: int) -> None:
        """Hand the turn to the next row that has not ended (called holding the lock)."""
        nxt = row + 1
        while nxt < self.rows and self._done[nxt]:
            nxt += 1
        if nxt < self.rows:
            self._turn = nxt
            self._cv.notify_all()
            return
        # every later row ended: the rows at the meeting wait for rows that will never come
        ended = [r for r in range(self.rows) if self._done[r]]
        if self._waiting:
            at = next(iter(self._waiting.values()))[0]
            self._fail(LockstepError(f"rows {sorted(self._waiting)} wait at {at}, but rows {ended} ended without "
                                     "coming: every rank must run the same collectives in its forward and backward"))

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._cv.notify_all()

    def _row(self, row: int, body: Callable[[int], Any], out: list[Any]) -> None:
        _local.where = (self, row)
        try:
            with self._cv:
                while self._turn != row and self._error is None:
                    self._cv.wait()
                if self._error is not None:
                    return
            out[row] = body(row)
        except LockstepError as e:
            with self._cv:
                self._fail(e)
        except BaseException as e:  # noqa: BLE001 - raised by run()
            with self._cv:
                self._fail(e)
        finally:
            _local.where = None
            with self._cv:
                self._done[row] = True
                if self._error is None:
                    self._pass_turn(row)
