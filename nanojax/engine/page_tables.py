"""The runner's page tables, kept on the host from step to step.

A step's page table is [rows, pages] of the running sequences' KV pages. Built afresh, it
reads every page of every row each step (1,000 rows of a 1,024-token context: ~50,000
Python ints, most of the step's input time); kept here, a sequence's row is written only
where its pages changed (a decode gains a page once in page_size steps), and a step's
table is one gather of its rows.

A Sequence's page list is only ever extended in place; the scheduler gives it a new list
where it frees or re-matches pages (preemption, a prefix-cache match), which a row notices
by the list's identity and rewrites in full.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from nanojax.engine.sequence import Sequence


class PageTables:
    def __init__(self, width: int, capacity: int = 64):
        self.width = width  # pages a sequence may have (max_model_len / page_size, rounded up)
        self.table = np.zeros((capacity, width), np.int32)
        self._filled = [0] * capacity         # entries written in each row
        self._lists: list = [None] * capacity  # the page list each row holds
        self._free = list(range(capacity - 1, -1, -1))
        self._row_of: dict[Sequence, int] = {}

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The table rows of seqs, each brought up to date with its pages."""
        out = np.empty(len(seqs), np.intp)
        row_of, lists, filled, table = self._row_of, self._lists, self._filled, self.table
        for i, seq in enumerate(seqs):
            row = row_of.get(seq)
            if row is None:
                row = self._assign(seq)
                table = self.table  # (it may have grown)
            pages = seq.pages
            n = len(pages)
            if pages is not lists[row] or n < filled[row]:  # a new list: the whole row
                table[row, :n] = pages
                if filled[row] > n:
                    table[row, n:filled[row]] = 0
                lists[row], filled[row] = pages, n
            elif n != filled[row]:  # extended: its new pages
                table[row, filled[row]:n] = pages[filled[row]:]
                filled[row] = n
            out[i] = row
        return out

    def release(self, seq: Sequence) -> None:
        """seq is gone: its row is cleared for the next sequence."""
        row = self._row_of.pop(seq, None)
        if row is None:
            return
        self.table[row, :self._filled[row]] = 0
        self._filled[row], self._lists[row] = 0, None
        self._free.append(row)

    def __len__(self) -> int:
        """Sequences holding a row."""
        return len(self._row_of)

    def _assign(self, seq: Sequence) -> int:
        if not self._free:  # twice the rows
            n = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._filled += [0] * n
            self._lists += [None] * n
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._row_of[seq] = self._free.pop()
        return row
