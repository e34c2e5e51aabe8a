"""The host arena: first-fit blocks, alignment, coalescing, exhaustion; a random alloc/free state machine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from workers.staging.arena import ALIGN, Block, HostArena

KB = 1024


def test_alloc_rounds_up_and_aligns() -> None:
    arena = HostArena(8 * KB, pin=True)
    assert arena.pinned == torch.cuda.is_available()  # pinned only where a GPU can use it
    assert arena.buffer.numel() == 8 * KB and arena.buffer.dtype == torch.uint8
    blocks = [arena.alloc(n) for n in (1, 0, 128, 129, 1000)]
    assert [b.nbytes for b in blocks if b] == [128, 128, 128, 256, 1024]
    assert [b.offset for b in blocks if b] == [0, 128, 256, 384, 640]
    assert all(b is not None and b.offset % ALIGN == 0 for b in blocks)
    assert arena.used_bytes == 1664
    arena.check_integrity()


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    arena = HostArena(4 * KB, pin=False)
    assert arena.alloc(4 * KB + 1) is None
    full = arena.alloc(4 * KB)
    assert full == Block(0, 4 * KB)
    assert arena.alloc(1) is None
    assert arena.used_bytes == 4 * KB
    arena.check_integrity()
    arena.free(full)
    assert arena.used_bytes == 0 and arena.alloc(4 * KB) == Block(0, 4 * KB)


def test_free_coalesces_with_both_neighbours() -> None:
    arena = HostArena(4 * KB, pin=False)
    a, b, c, d = (arena.alloc(KB) for _ in range(4))
    assert a and b and c and d
    arena.free(a)
    arena.free(c)
    assert arena.alloc(2 * KB) is None  # 2 KiB free, but in two separate 1 KiB holes
    arena.free(b)  # merges with a (before) and c (after): one 3 KiB hole
    arena.check_integrity()
    assert arena.alloc(3 * KB) == Block(0, 3 * KB)
    arena.free(Block(0, 3 * KB))
    arena.free(d)
    arena.check_integrity()
    assert arena.alloc(4 * KB) == Block(0, 4 * KB)  # everything coalesced back into one range


def test_first_fit_reuses_the_first_hole() -> None:
    arena = HostArena(8 * KB, pin=False)
    blocks = [arena.alloc(KB) for _ in range(6)]
    arena.free(blocks[1])
    arena.free(blocks[4])
    assert arena.alloc(512) == Block(KB, 512)  # the first hole that fits, split
    assert arena.alloc(KB) == Block(4 * KB, KB)  # the rest of the first hole is too small
    assert arena.alloc(2 * KB) == Block(6 * KB, 2 * KB)  # the tail
    arena.check_integrity()


def test_view_is_a_typed_window_of_the_buffer() -> None:
    arena = HostArena(4 * KB, pin=False)
    arena.buffer.zero_()  # the arena's memory is uninitialized: it may hold 1.5s from an earlier test
    arena.alloc(128)
    block = arena.alloc(1000)
    assert block is not None
    view = arena.view(block, torch.bfloat16, 300)
    assert view.dtype == torch.bfloat16 and view.shape == (300,)
    view.fill_(1.5)
    assert torch.equal(arena.buffer[128 : 128 + 600].view(torch.bfloat16), view)
    assert view.data_ptr() == arena.buffer.data_ptr() + 128
    assert arena.buffer[128 + 600 : 128 + 1024].view(torch.bfloat16).ne(1.5).all()


def test_double_free_and_foreign_block_raise() -> None:
    arena = HostArena(4 * KB, pin=False)
    block = arena.alloc(KB)
    assert block is not None
    arena.free(block)
    with pytest.raises(KeyError):
        arena.free(block)
    with pytest.raises(KeyError):
        arena.free(Block(512, 128))
    arena.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    arena = HostArena(4 * KB, pin=False)
    arena.alloc(KB)
    arena._free = [(KB, KB)]  # lose 2 KiB
    with pytest.raises(AssertionError, match="free \\+ used bytes != capacity"):
        arena.check_integrity()
    arena._free = [(KB, KB), (2 * KB, 2 * KB)]  # adjacent free ranges left unmerged
    with pytest.raises(AssertionError, match="not coalesced"):
        arena.check_integrity()


CAPACITY = 16 * KB


class ArenaMachine(RuleBasedStateMachine):
    """Random alloc/free against a model of live blocks; each block's bytes carry a tag that must survive."""

    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.arena = HostArena(CAPACITY, pin=False)
        self.live: dict[int, tuple[int, int]] = {}  # offset -> (size, tag)
        self.tag = 0

    def largest_gap(self) -> int:
        edges = sorted((off, size) for off, (size, _) in self.live.items())
        best, pos = 0, 0
        for off, size in [*edges, (CAPACITY, 0)]:
            best, pos = max(best, off - pos), off + size
        return best

    @rule(target=blocks, nbytes=st.integers(0, 6 * KB))
    def alloc(self, nbytes: int) -> Block | None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        fits = self.largest_gap() >= size
        block = self.arena.alloc(nbytes)
        assert (block is not None) == fits, f"alloc({nbytes}) -> {block}, largest gap {self.largest_gap()}"
        if block is None:
            return None
        assert block.offset % ALIGN == 0 and block.nbytes == size
        gaps_before = [o for o in self.live if o < block.offset]
        assert all(o + self.live[o][0] <= block.offset for o in gaps_before)
        assert all(block.offset + size <= o for o in self.live if o > block.offset)
        self.tag = self.tag % 250 + 1
        self.arena.buffer[block.offset : block.offset + size] = self.tag
        self.live[block.offset] = (size, self.tag)
        return block

    @rule(block=consumes(blocks))
    def free(self, block: Block | None) -> None:
        if block is None:
            return
        size, tag = self.live.pop(block.offset)
        assert bool((self.arena.buffer[block.offset : block.offset + size] == tag).all()), (
            "block was clobbered"
        )
        self.arena.free(block)

    @invariant()
    def consistent(self) -> None:
        self.arena.check_integrity()
        assert self.arena.used_bytes == sum(s for s, _ in self.live.values()) <= CAPACITY
        assert dict(self.arena._used) == {o: s for o, (s, _) in self.live.items()}


ArenaMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestArenaMachine = ArenaMachine.TestCase
