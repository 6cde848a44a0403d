"""The segment arithmetic (``vocab/segments.py``, ``documents.py``, ``keys.py``,
``blocks.py``) against position lists built from the layouts' definitions.

Each expected value is derived here from first principles: the positions a rank
holds are listed chunk by chunk as the layout defines them, and the keys a
query may see come from a per-pair visibility rule (same document, key position
<= query position). The code under test works on runs of positions instead.
"""
import itertools

import pytest

from mindspeed_laga.vocab.blocks import join_adjacent, query_block_rows
from mindspeed_laga.vocab.documents import check_documents, doc_pieces, document_of
from mindspeed_laga.vocab.keys import key_blocks, key_ranges, key_window, visible_keys
from mindspeed_laga.vocab.segments import query_segments, rank_segments


def runs(positions):
    """(local_start, length, global_start) of each run of consecutive positions."""
    out = []
    for local, pos in enumerate(positions):
        if out and out[-1][2] + out[-1][1] == pos:
            out[-1] = (out[-1][0], out[-1][1] + 1, out[-1][2])
        else:
            out.append((local, 1, pos))
    return out


def expand(segments):
    """The positions segments hold, in local order."""
    return [g + i for _, n, g in segments for i in range(n)]


def local_starts_follow_on(segments):
    """A rank's segments tile its local tokens from row 0, in order."""
    return [s[0] for s in segments] == [sum(n for _, n, _ in segments[:i])
                                        for i in range(len(segments))]


def zigzag_positions(seq_len, cp, rank):
    """Chunks r and 2P-1-r of 2P equal chunks."""
    c = seq_len // (2 * cp)
    return [chunk * c + i for chunk in (rank, 2 * cp - 1 - rank) for i in range(c)]


def hybrid_positions(seq_len, cp, degree, rank):
    """Zigzag over the R = P/U ring ranks, the ring rank's pair cut into U pieces."""
    ring, u = divmod(rank, degree)
    pair = zigzag_positions(seq_len, cp // degree, ring)
    piece = len(pair) // degree
    return pair[u * piece:(u + 1) * piece]


def doc_zigzag_positions(bounds, cp, rank):
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * cp)
        out += [a + chunk * c + i for chunk in (rank, 2 * cp - 1 - rank) for i in range(c)]
    return out


def doc_id(pos, bounds):
    return next(i for i in range(len(bounds) - 1) if bounds[i] <= pos < bounds[i + 1])


def visible(q, k, causal, bounds):
    same = bounds is None or doc_id(q, bounds) == doc_id(k, bounds)
    return same and (k <= q or not causal)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_and_contiguous_segments(cp):
    seq_len = 24 * cp
    local = seq_len // cp
    for rank in range(cp):
        zigzag = rank_segments("zigzag", cp, rank, local)
        assert expand(zigzag) == zigzag_positions(seq_len, cp, rank)
        assert local_starts_follow_on(zigzag)
        assert rank_segments("contiguous", cp, rank, local) == runs(range(rank * local, (rank + 1) * local))


@pytest.mark.parametrize("cp,degree", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_hybrid_zigzag_segments(cp, degree):
    seq_len = 48 * cp
    held = []
    for rank in range(cp):
        want = hybrid_positions(seq_len, cp, degree, rank)
        got = rank_segments("zigzag", cp, rank, seq_len // cp, ulysses_degree=degree)
        assert expand(got) == want and local_starts_follow_on(got)
        held += want
    assert sorted(held) == list(range(seq_len))  # every position on exactly one rank


@pytest.mark.parametrize("cp", [2, 4])
def test_doc_zigzag_segments(cp):
    step = 2 * cp
    bounds = (0, 3 * step, 4 * step, 8 * step)
    for rank in range(cp):
        want = doc_zigzag_positions(bounds, cp, rank)
        assert expand(rank_segments("doc_zigzag", cp, rank, len(want), bounds)) == want


@pytest.mark.parametrize("cp,degree", [(4, 1), (4, 2), (2, 1)])
def test_query_segments_of_split_heads_are_the_groups_tokens_in_rank_order(cp, degree):
    seq_len, local = 16 * cp, 16
    for rank in range(cp):
        first = rank // degree * degree if degree > 1 else 0
        members = range(first, first + degree) if degree > 1 else range(cp)
        want = []
        for r in members:
            want += (hybrid_positions(seq_len, cp, degree, r) if degree > 1
                     else zigzag_positions(seq_len, cp, r))
        got = query_segments("zigzag", cp, rank, local, True, ulysses_degree=degree)
        assert expand(got) == want
        assert local_starts_follow_on(got)
        own = query_segments("zigzag", cp, rank, local, False, ulysses_degree=degree)
        assert expand(own) == (hybrid_positions(seq_len, cp, degree, rank) if degree > 1
                               else zigzag_positions(seq_len, cp, rank))


DOCS = [None, (0, 5, 16, 17, 32), (0, 32)]


@pytest.mark.parametrize("bounds", DOCS, ids=["plain", "ragged", "one_doc"])
@pytest.mark.parametrize("causal", [True, False])
def test_key_windows_and_ranges_hold_exactly_the_visible_keys(bounds, causal):
    total = 32
    for cp, rank in itertools.product((2, 4), range(4)):
        if rank >= cp:
            continue
        segments = rank_segments("zigzag", cp, rank, total // cp)
        seen = set()
        for seg in segments:
            queries = expand([seg])
            keys = [k for k in range(total) if any(visible(q, k, causal, bounds) for q in queries)]
            lo, hi = key_window(seg, total, causal, bounds)
            # the window is the span of the visible keys (keys inside it that no query sees
            # belong to other documents the segment crosses, and its pieces exclude them)
            assert (lo, hi) == (min(keys), max(keys) + 1)
            seen |= set(keys)
        ranges = key_ranges(segments, total, causal, bounds)
        covered = {k for lo, hi in ranges for k in range(lo, hi)}
        assert seen <= covered
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # sorted, disjoint, apart
        if bounds is None:
            assert ranges == [(0, visible_keys(segments, total, causal))]


def test_doc_pieces_cut_at_boundaries():
    bounds = (0, 5, 16, 17, 32)
    for seg in [(0, 32, 0), (3, 10, 4), (0, 1, 16), (2, 3, 29)]:
        pieces = doc_pieces(seg, bounds)
        assert expand(pieces) == expand([seg])
        for local, n, g in pieces:
            assert len({doc_id(p, bounds) for p in range(g, g + n)}) == 1
        assert [p[0] for p in pieces] == [seg[0] + sum(n for _, n, _ in pieces[:i])
                                          for i in range(len(pieces))]
        assert len(pieces) == len({doc_id(p, bounds) for p in expand([seg])})
    assert doc_pieces((0, 7, 3), None) == [(0, 7, 3)]
    assert [document_of(p, bounds) for p in (0, 4, 5, 16, 31)] == [0, 0, 1, 2, 3]


def test_check_documents_names_the_fix():
    assert check_documents([0, 4, 8], 8, "zigzag", 2) == (0, 4, 8)
    for bad, words in [([0, 4, 7], "0 to the full"), ([0, 4, 4, 8], "increase strictly"),
                       ([0, 3, 8], "pad each document")]:
        with pytest.raises(ValueError, match=words):
            check_documents(bad, 8, "doc_zigzag", 2)


@pytest.mark.parametrize("segments", [
    [(0, 4, 0), (4, 4, 4), (8, 4, 12)],        # first two continue each other
    [(0, 4, 8), (4, 4, 0)],                     # next local row but an earlier position
    [(0, 2, 0), (2, 2, 2), (4, 2, 4), (6, 2, 6)],
    [(0, 3, 5)],
])
def test_join_adjacent_joins_exactly_the_continuing_runs(segments):
    joined = join_adjacent(segments)
    assert expand(joined) == expand(segments)
    local = [ls + i for ls, n, _ in segments for i in range(n)]
    assert joined == runs_of_pairs(list(zip(local, expand(segments))))


def runs_of_pairs(pairs):
    """Runs along which both the local row and the position go up by one."""
    out = []
    for local, pos in pairs:
        if out and out[-1][0] + out[-1][1] == local and out[-1][2] + out[-1][1] == pos:
            out[-1] = (out[-1][0], out[-1][1] + 1, out[-1][2])
        else:
            out.append((local, 1, pos))
    return out


def test_key_blocks_and_row_blocks():
    assert key_blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert key_blocks(10, None) == [(0, 10)]
    assert key_blocks(0, None) == []
    assert query_block_rows(None) is None
    assert query_block_rows(64) == 128  # two key blocks of rows
