"""What crosses the engine's seams: the run's context, per-batch stats, the input records
that are not items (`Rejected`, `Skipped`), and the failure window the loop and admission
watch for a recurring failure."""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.vocab.geometry import Device


@dataclass
class RunContext:
    """What every hook sees about the run it belongs to."""

    function: str  # function name, e.g. "probe_gen"
    batching: str  # batching mode name
    devices: list[Device]  # consumers, each with its effective limits
    run_dir: Path | str | None  # where outputs go: a local path or an fsspec URL; None for a plan
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, plain containers
    dry_run: bool = False  # true for `forge plan`: nothing runs, timings are simulated
    expected_items: int | None = None  # records in the input, when known (progress bar total)
    state: dict[str, Any] = field(default_factory=dict)  # per-plugin state, keyed by plugin name
    timings: dict[str, float] = field(default_factory=dict)  # phase figures so far, for the report's "phases"
    # the recurring-bad-input watch over records read: set by the run loop from its policy;
    # admission adds every record's outcome (None: no watch)
    input_window: FailureWindow | None = None
    # the trackers the config selects (`trackers=[...]`): name -> (factory or import path, plugin's
    # name), from the `forge_trackers` registry; empty for a plan
    trackers: dict[str, tuple[Any, str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BatchStats:
    """What running one batch cost."""

    seconds: float  # wall time on the device (simulated for a plan)
    prefix_computed_tokens: int  # prefix tokens actually run this step (0 on a cache hit)
    cache_hit_tokens: int  # prefix tokens the items needed but did not run: the cache held them
    padded_slots: int  # row slots run plus prefix tokens run
    shared_tokens: int = 0  # prefix tokens the items needed that a tree row ran once for several of them
    # token slots of each forward step it ran: its padded rows in one pass, or an engine's own steps
    # (generate's decoder); () for a part of a batch committed while it runs (its steps come at its end)
    steps: tuple[int, ...] = ()
    # an engine sharing prefixes itself (generate's decoder): the prefixes it computed for these items,
    # once each however many items share one (None: counted from the batch's layout)
    prefix_runs: int | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    """An input record that could not become an item: a recorded failure."""

    record_id: str  # the row's id, or "line N" / "row N" where it has no usable one
    reason: str  # one line: where, what is wrong and how to fix it
    kind: str = ""  # the reason without its place, e.g. "invalid JSON" ("": derived from `reason`)


@dataclass(frozen=True, slots=True)
class Skipped:
    """An input record that is deliberately not run (a repeated id under
    `input.duplicate_ids=first|last`): counted as received and skipped, with no tokens."""

    record_id: str  # the row's id
    reason: str  # one line: where, why, and what is kept instead
    kind: str  # the reason without its place, e.g. "duplicate id (input.duplicate_ids=first)"
    line: int | None = None  # JSONL line number, where known


_PLACE = re.compile(r"^(?:line|row|item) \S+(?: \(id .*?\))?:? ")


def reason_kind(reason: str) -> str:
    """What a reason says without where: its place ("line 7 (id 'x'): "), values in
    parentheses and numbers dropped, cut at the fix. Reasons of one kind recur as one
    reason toward `max_failure_share`, though each names its own line."""
    text = _PLACE.sub("", reason, count=1).split(";", 1)[0]
    text = re.sub(r"\s*\([^()]*\)", "", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", lambda m: m.group(0) if len(m.group(0)) <= 24 else "'...'", text)
    return re.sub(r"\d+", "N", text).strip()[:120] or reason[:120]


class FailureWindow:
    """The last `size` outcomes (None: fine, else a failure's kind) and how often each kind
    holds; `stop` says which kind fills `share` of the window, with an example reason."""

    def __init__(self, size: int, share: float):
        self.size = max(1, size)
        self.recent: deque[str | None] = deque(maxlen=self.size)
        self.counts: Counter = Counter()
        self.share = share
        self.examples: dict[str, str] = {}  # kind -> the first full reason of it in the window
        self.stop: str | None = None  # "<n> of the last <size> ... failed with: <kind> (e.g. <reason>)"

    def add(self, kinds: Iterable[str | None], what: str = "items", examples: dict[str, str] | None = None) -> None:
        """Outcomes in order; `examples` maps kinds to a full reason of each (for the stop line)."""
        recent, counts = self.recent, self.counts
        kinds = list(kinds)
        if not any(kinds) and not any(counts.values()):
            recent.extend(kinds)  # all fine and no failure in the window: nothing to count (C speed)
            return
        for kind in kinds:
            if len(recent) == self.size:
                old = recent.popleft()
                if old is not None:
                    counts[old] -= 1
                    if not counts[old]:
                        del counts[old]
                        self.examples.pop(old, None)
            recent.append(kind)
            if kind is not None:
                counts[kind] += 1
                if examples and kind in examples:
                    self.examples.setdefault(kind, examples[kind])  # the first one seen
        if any(kinds):
            self._judge(self.size, what)

    def judge_partial(self, what: str = "items") -> None:
        """At the end of the input: a window never filled is judged over what it holds."""
        if self.recent and len(self.recent) < self.size:
            self._judge(len(self.recent), what)

    def _judge(self, size: int, what: str) -> None:
        if self.stop is not None or not self.counts:
            return
        kind, n = self.counts.most_common(1)[0]
        if n >= self.share * size:
            example = self.examples.get(kind)
            self.stop = f"{n} of the last {size} {what} failed with: {kind}" + (
                f" (e.g. {example})" if example and example != kind else ""
            )


def batch_stats(
    batch,
    seconds: float,
    prefix_computed_tokens: int,
    engine_prefix: tuple[int, int, int] | None = None,
    steps: Iterable[int] | None = None,
    root_held_tokens: int = 0,
) -> BatchStats:
    """Stats of a batch from what its prefix cost. Rows that hold whole sequences run
    their own prefix, so nothing is served from cache, unless the function's engine shares
    prefixes itself (`engine_prefix`: the cache-hit and shared prefix tokens it did not run, and the
    prefixes it ran);
    tree rows run each prefix group's prefix once in the row (shared), but for the `root_held_tokens` a
    root their prefixes share held: served from the cache, or shared when the root ran now (its
    `prefix_computed_tokens`). `steps`: the token slots of each step an engine of its own ran (None: one
    forward pass of the padded rows)."""
    ran = (batch.padded_slots,) if steps is None else tuple(steps)
    if engine_prefix is not None and not (batch.tree or batch.split_prefix):
        hit, shared, runs = engine_prefix
        return BatchStats(seconds, batch.prefix_tokens - hit - shared, hit, batch.padded_slots, shared, ran, runs)
    if batch.tree:
        spans = batch.row_tokens - (batch.num_tokens - batch.prefix_tokens)  # the rows' prefix spans, laid out
        root_held_tokens = min(root_held_tokens, spans)  # of a batch's items kept (others committed already)
        root_run = min(prefix_computed_tokens, root_held_tokens) if root_held_tokens else 0
        computed, hit = spans - root_held_tokens + root_run, 0 if root_run else root_held_tokens
        shared = batch.prefix_tokens - computed - hit
        return BatchStats(seconds, computed, hit, batch.padded_slots + root_run, shared, ran)
    if batch.split_prefix:
        hit = batch.prefix_tokens - prefix_computed_tokens
    else:
        prefix_computed_tokens, hit = batch.prefix_tokens, 0
    extra = prefix_computed_tokens if batch.split_prefix else 0
    return BatchStats(seconds, prefix_computed_tokens, hit, batch.padded_slots + extra, 0, ran)


@dataclass
class ResultColumns:
    """A batch's output for the generic sink: one value per item for each result field."""

    columns: dict[str, Any]  # field name -> numpy array [n_items, *shape] (or a list of str), batch.items order
    prefix_computed_tokens: int = 0  # prefix tokens run this step (0 on a prefix-cache hit)
    cache_hit: bool = False  # the prefix came from the device's cache
    # an engine sharing prefixes itself (generate's decoder) in whole-sequence rows: the prefix tokens
    # it did not run (held by its cache from earlier batches, computed once for several items), and
    # how many prefixes it ran for these items
    engine_prefix: tuple[int, int, int] | None = None
    # an engine that runs a batch in steps of its own (generate's decoder): the token slots of each step
    # it ran for this output (None: the batch ran as one forward pass); the ledger holds them to the budget
    steps: list[int] | None = field(default=None, kw_only=True)
    # tree rows after a root their prefixes share: the prefix tokens the rows did not hold (the root ran
    # once, or came from the cache: `prefix_computed_tokens` says which)
    root_held_tokens: int = field(default=0, kw_only=True)
