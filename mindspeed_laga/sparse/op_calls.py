"""The fused ops' calls of one stage: which query rows and keys each reads, in which layout.

Without documents every chunk of this rank's queries (a run of consecutive positions) is
one BSND call against the key prefix ``[0, chunk end)``. With packed documents (micro-batch
1) the chunks arrive cut at the document boundaries (``sparse/form.py``); the pieces of
one run of consecutive positions are one TND call: each piece a TND sequence against its
document's keys ``[document start, piece end)``. Those key ranges tile the run's key range
(a piece that is not the run's last ends where its document ends, where the next one
starts), so the call reads one slice of the gathered keys, with cumulative lengths.
Everything here is host arithmetic on the chunks: no device value is read.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Union

import torch

from .stage import Chunk


class OpCall(NamedTuple):
    rows: slice                 # the local query rows it reads
    keys: slice                 # the key positions it reads
    layout: str                 # "BSND" or "TND"
    query_ends: Optional[List[int]]  # TND: cumulative query lengths of its sequences
    key_ends: Optional[List[int]]    # TND: cumulative key lengths of its sequences
    first_key: Union[int, torch.Tensor]  # what its picks count from: 0, or [rows] per row

    def part(self, x, keys: bool = False):
        """``x`` [b, seq, ...] (queries, or keys with ``keys``) as the call reads it."""
        cut = self.keys if keys else self.rows
        return x[:, cut] if self.layout == "BSND" else x[0, cut]

    def part_stats(self, x):
        """Softmax statistics [b, 1, s, n] as the call reads them (TND: [1, T, n])."""
        return x[:, :, self.rows] if self.layout == "BSND" else x[0][:, self.rows]

    def batched(self, y):
        """An op output of the call's queries back in [b, s, ...]."""
        return y if self.layout == "BSND" else y.unsqueeze(0)

    def batched_stats(self, y):
        """Softmax statistics of the call's queries back in [b, 1, s, n]."""
        return y if self.layout == "BSND" else y.unsqueeze(0)

    def lengths(self, query_name: str, key_name: str, as_list: bool = False, device=None):
        """The ops' keyword arguments for the TND lengths (none under BSND): int32 tensors,
        or lists (the KL loss takes lists)."""
        if self.layout == "BSND":
            return {}
        if as_list:
            return {query_name: self.query_ends, key_name: self.key_ends}
        device = self.first_key.device
        return {name: torch.tensor(ends, dtype=torch.int32).to(device)
                for name, ends in ((query_name, self.query_ends), (key_name, self.key_ends))}


def op_calls(call) -> List[OpCall]:
    """One call per run of consecutive query positions (module docstring)."""
    if call.query_start is None:
        return [OpCall(slice(c.start, c.start + c.length), slice(0, c.key_end), "BSND",
                       None, None, 0) for c in call.chunks]
    return [_tnd_call(run, call.query_start) for run in _runs(call.chunks)]


def _runs(chunks: List[Chunk]) -> List[List[Chunk]]:
    """The chunks grouped into runs of consecutive rows and positions, one piece per
    document in each (zigzag's two chunks of a middle rank may meet inside a document)."""
    runs: List[List[Chunk]] = []
    for chunk in chunks:
        last = runs[-1][-1] if runs else None
        if last is None or chunk.start != last.start + last.length \
                or chunk.key_end - chunk.length != last.key_end:
            runs.append([chunk])
        elif chunk.key_start == last.key_start:  # the same document goes on
            runs[-1][-1] = Chunk(last.start, last.length + chunk.length, chunk.key_end,
                                 last.key_start)
        else:
            runs[-1].append(chunk)
    return runs


def _tnd_call(run: List[Chunk], query_start) -> OpCall:
    first, last = run[0], run[-1]
    rows = slice(first.start, last.start + last.length)
    query_ends, key_ends, total = [], [], 0
    for piece in run:
        total += piece.length
        query_ends.append(total)
        key_ends.append(piece.key_end - first.key_start)
    return OpCall(rows, slice(first.key_start, last.key_end), "TND", query_ends, key_ends,
                  query_start[rows])
