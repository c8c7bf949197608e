"""Contiguous stages: which member of a device group holds which blocks of a model (plain numbers).

Model: a model is a sequence of blocks in forward order (embeddings, each decoder layer, the
final norm, the head), each with its weight bytes. A group's members take contiguous runs of
them in member order. Member i holding blocks of W_i bytes needs, while a batch runs,

    W_i + fixed + activations <= budget_i

where `fixed` is the measured memory model's fixed overhead beyond the weights and the
activations are the whole (cut) model's for the batch: a stage holds its own layers' KV and
the transients of one layer at a time, never more than the whole model does, so pricing each
stage with the whole model's activations is safe. The placement maximises the activation room
R left on every holding stage (binary search on R; for a given R the greedy fill, each member
taking blocks while they fit, is the contiguous split that fits if any does), so the tightest
stage has as much room for batches as any split allows. It needs R >= `reserve_min`, the
activations of one full-length row; short of that, with offload allowed, members are filled
with `reserve_min` each and the remaining tail is offloaded: its blocks run on the first member
(accelerate's execution device), which also keeps room to stream in the largest of them.
Without offload the model is refused, with the reason in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Split:
    """Blocks per member, and what is left over (offloaded)."""

    counts: tuple[int, ...]  # blocks held by each member, in order (a contiguous run each)
    weights: tuple[int, ...]  # their weight bytes per member
    room: tuple[
        int, ...
    ]  # per member: budget - weights - fixed (- a streamed block, first member): its activation room
    offloaded: int  # blocks past the members', offloaded (0: none)
    offloaded_bytes: int
    streamed_bytes: int  # the largest offloaded block: room the first member keeps to run it

    @property
    def tightest_room(self) -> int:
        """The least activation room of a member that holds blocks (or runs offloaded ones)."""
        used = [r for i, (r, n) in enumerate(zip(self.room, self.counts)) if n or (i == 0 and self.offloaded)]
        return min(used)


def fill(sizes: list[int], budgets: list[int], fixed: int, reserve: int, streamed: int = 0) -> list[int]:
    """Blocks each member takes, greedily in order, keeping `reserve` (and `fixed`; the first
    member also `streamed`) free; the blocks left over are those past the last count."""
    counts, k = [], 0
    for i, budget in enumerate(budgets):
        room = budget - fixed - reserve - (streamed if i == 0 else 0)
        used, n = 0, 0
        while k + n < len(sizes) and used + sizes[k + n] <= room:
            used += sizes[k + n]
            n += 1
        counts.append(n)
        k += n
    return counts


def _split(sizes: list[int], budgets: list[int], fixed: int, counts: list[int], streamed: int) -> Split:
    weights, k = [], 0
    for n in counts:
        weights.append(sum(sizes[k : k + n]))
        k += n
    left = sizes[k:]
    room = tuple(b - w - fixed - (streamed if i == 0 else 0) for i, (b, w) in enumerate(zip(budgets, weights)))
    return Split(tuple(counts), tuple(weights), room, len(left), sum(left), streamed)


def best_split(sizes: list[int], budgets: list[int], fixed: int) -> Split | None:
    """The split with the most activation room on its tightest stage, nothing offloaded; None
    when the members cannot hold every block even with no room left."""
    if sum(fill(sizes, budgets, fixed, 0)) < len(sizes):
        return None
    lo, hi = 0, max(budgets)  # lo fits; find the largest reserve that still does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(fill(sizes, budgets, fixed, mid)) == len(sizes):
            lo = mid
        else:
            hi = mid - 1
    return _split(sizes, budgets, fixed, fill(sizes, budgets, fixed, lo), 0)


def offload_split(sizes: list[int], budgets: list[int], fixed: int, reserve: int) -> Split | None:
    """Members filled keeping `reserve` each, the tail offloaded, the first member keeping room
    to stream in the largest offloaded block; None when the first member cannot even do that."""
    streamed = 0
    for _ in range(len(sizes) + 1):  # the streamed block only grows as the first member gives up room
        counts = fill(sizes, budgets, fixed, reserve, streamed)
        tail = sizes[sum(counts) :]
        largest = max(tail, default=0)
        if largest <= streamed:
            break
        streamed = largest
    split = _split(sizes, budgets, fixed, counts, streamed)
    return split if split.room[0] >= reserve else None


def deepest_that_fits(
    layer_sizes: list[int], head: int, tail: int, budgets: list[int], fixed: int, reserve: int
) -> int:
    """Decoder layers (of uniform or not sizes, in order) that fit beside the blocks before
    (`head` bytes) and after them (`tail`: the final norm) with `reserve` room per stage: what
    a function cut at that depth could run (for the refusal's advice)."""
    best = 0
    for keep in range(1, len(layer_sizes) + 1):
        sizes = [head, *layer_sizes[:keep], tail]
        if sum(fill(sizes, budgets, fixed, reserve)) < len(sizes):
            break
        best = keep
    return best


def gib(n: int | float) -> str:
    """Bytes in GiB (MiB below one GiB: a small model's blocks)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"
