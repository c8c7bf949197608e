"""Many prefix groups in one batch (`batching.merge_groups`, tree rows): the packer merges small
prefix groups into tree batches only where that costs less, every item once within the limits;
and tree rows give what one-prompt-at-a-time forward passes give, for probe_gen (pooled and
per token) and score (tests/test_fidelity.py runs them in every family, and checks they are
left off where packed rows would not be exact)."""

import json
from collections import Counter

import pytest

from forge.batching import TokenPacker
from forge.config.modes import TokenBatching
from forge.core.scheduler import Scheduler
from forge.testing import check_modes
from forge.vocab.geometry import Device, Item, Limits, broken_limit, row_used

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
LIMITS = Limits(max_batch_tokens=4096, max_rows=64, max_seq_len=1024, pad_multiple=8)


def questions(n: int, choices: int = 4, context: int = 120) -> list[Item]:
    """Score-like geometry: n distinct contexts of `context`/6 to `context` tokens, each with a few
    short continuations."""
    items = []
    for q in range(n):
        p = context // 6 + (q * 37) % (context - context // 6)
        for c in range(choices):
            items.append(Item(f"q{q}c{c}", p + 1 + (q + c) % 5, f"ctx{q}", p))
    return items


def drain(packer, items, limits=LIMITS, window=100_000):
    dev = Device("d0", limits)
    sched = Scheduler(packer, items, [dev], window=window, cache_tokens=100_000)
    batches = []
    while not sched.done:
        batch = sched.schedule(dev)
        assert batch is not None
        batches.append(batch)
    return batches


def runs(row):
    """The prefix keys of a row's runs of items, in order."""
    keys = []
    for it in row:
        if not keys or keys[-1] != it.prefix_key:
            keys.append(it.prefix_key)
    return keys


def test_small_prefix_groups_share_tree_batches_every_item_once():
    items = questions(300)
    batches = drain(TokenPacker(), items)
    assert Counter(it.id for b in batches for it in b.items) == Counter(it.id for it in items)
    trees = [b for b in batches if b.tree]
    assert trees and len(batches) <= 300 // 8  # one batch per question without merging
    for b in trees:
        assert broken_limit(b, LIMITS) is None
        assert b.packed and not b.split_prefix and b.prefix_key is None
        for row in b.rows:
            keys = runs(row)
            assert len(keys) == len(set(keys))  # each group's items sit together: its prefix once per row
            assert row_used(row, 0, True) == sum(
                it.prefix_len for it in {it.prefix_key: it for it in row}.values()
            ) + sum(it.num_tokens - it.prefix_len for it in row)
        assert b.padding == b.padded_slots - sum(row_used(r, 0, True) for r in b.rows) >= 0
    assert max(len(runs(row)) for b in trees for row in b.rows) >= 2  # rows hold several prefixes
    # rows are as long as their longest group (prefix + suffixes) needs, or as max_rows rows
    # filling max_batch_tokens need, not max_seq_len
    for b in trees:
        units = Counter()
        for it in b.items:
            units[it.prefix_key] += it.num_tokens - it.prefix_len
        longest = max(units[it.prefix_key] + it.prefix_len for it in b.items)
        assert b.padded_len <= LIMITS.pad(max(longest, LIMITS.max_batch_tokens // LIMITS.max_rows))


def test_groups_that_fill_batches_and_merge_groups_false_stay_apart():
    big = [Item(f"b{i}", 60 + i % 40, "big", 50) for i in range(400)]  # one prefix, many suffixes
    assert not any(b.tree for b in drain(TokenPacker(), big))
    assert not any(b.tree for b in drain(TokenPacker(TokenBatching(merge_groups=False)), questions(100)))


def test_a_prefix_whose_batch_has_run_is_not_merged_when_its_own_batch_is_cheaper():
    """A long prefix that ran in a batch of its own (so the device's cache holds it) costs only its
    suffixes there; merging would compute it again. The same geometry never run merges."""
    dev = Device("d0", LIMITS)
    # tree rows up to 1,024 tokens
    packer = TokenPacker(TokenBatching(batch_overhead_tokens=64, packed_row_tokens=1024))
    first = [Item(f"a{i}", 600 + i % 20, "long", 590) for i in range(40)]  # too long to merge: runs apart
    later = [Item(f"z{i}", 600 + i, "long", 590) for i in range(2)] + [
        Item(f"o{i}", 600 + i, "other", 590) for i in range(2)
    ]
    sched = Scheduler(packer, first + later, [dev], window=40, cache_tokens=100_000)
    batches = []
    while not sched.done:
        if (batch := sched.schedule(dev)) is not None:
            batches.append(batch)
    assert Counter(it.id for b in batches for it in b.items) == Counter(it.id for it in first + later)
    kinds = {(b.tree, b.cache_hit, frozenset(it.prefix_key for it in b.items)) for b in batches}
    assert kinds == {
        (False, False, frozenset({"long"})),
        (False, True, frozenset({"long"})),
        (True, None, frozenset({"other"})),
    }


def test_packer_merges_only_where_the_cost_is_lower():
    """Same items, merging on and off, through the simulated step cost: merging never costs more."""
    from forge.vocab.geometry import step_cost

    def cost(batches, overhead=256):
        return sum(overhead + step_cost(b).tokens for b in batches)

    for items in (questions(200), questions(50, choices=12, context=300), questions(40, choices=2, context=30)):
        on, off = drain(TokenPacker(), items), drain(TokenPacker(TokenBatching(merge_groups=False)), items)
        assert cost(on) <= cost(off)


def _groups(units: list[tuple[int, int]], suffix: int = 20) -> list[Item]:
    """One small prefix group per (prefix, items): a tree unit of prefix + items x suffix tokens."""
    return [Item(f"g{g}i{i}", p + suffix, f"p{g}", p) for g, (p, n) in enumerate(units) for i in range(n)]


def _tree_shapes(batches) -> list[tuple[int, int]]:
    return [(b.num_rows, b.padded_len) for b in batches if b.tree]


def test_draining_a_unit_of_half_a_row_heads_shorter_rows_instead_of_padding_to_the_longest():
    """Units of 480 and 470 slots and four of 245-260 (too long to pair in a 480-slot row): one
    batch at the longest pads every short unit to 480 (2,880 slots); the two long units take one
    batch and the short ones a batch of rows of their own length (960 + 1,056 slots)."""
    items = _groups([(400, 4), (390, 4), (180, 4), (175, 4), (170, 4), (165, 4)])
    batches = drain(TokenPacker(TokenBatching(batch_overhead_tokens=256)), items)
    assert Counter(it.id for b in batches for it in b.items) == Counter(it.id for it in items)
    assert sorted(_tree_shapes(batches)) == [(2, 480), (4, 264)]
    assert all(broken_limit(b, LIMITS) is None for b in batches)


def test_units_past_the_shared_row_merge_each_in_a_row_alone_and_short_units_keep_short_rows():
    """Few-shot questions of 560-652-slot contexts (MMLU's shape) with four one-token choices: each
    group is too small for a batch of its own, so it merges, one unit a row (past 512 slots no
    unit shares a row); the short units run in rows of their own length, never in the long rows.
    Past 1,024 slots a unit does not merge, nor past 512 one whose suffixes are more than a quarter
    of its prefix (a row computes all its pairs); `packed_row_tokens` sets both lengths."""
    long = [Item(f"q{q}c{c}", 561 + 4 * q, f"long{q}", 560 + 4 * q) for q in range(24) for c in range(4)]
    short = _groups([(40, 1)] * 12)  # 60-slot units: they would fit the room a 564-slot unit leaves
    items = long + short
    limits = Limits(max_batch_tokens=8192, max_rows=64, max_seq_len=2048, pad_multiple=8)
    batches = drain(TokenPacker(), items, limits)
    assert Counter(it.id for b in batches for it in b.items) == Counter(it.id for it in items)
    assert all(b.tree for b in batches) and len(batches) <= 5  # 36 groups, not 36 batches
    for b in batches:
        assert broken_limit(b, limits) is None
        rows = b.rows
        lengths = {it.prefix_key.startswith("long") for row in rows for it in row}
        assert len(lengths) == 1  # a batch is long units or short ones, never both
        if lengths == {True}:
            assert all(len(runs(row)) == 1 for row in rows) and b.padded_len <= 656
        else:
            assert b.padded_len <= 512
    too_long = [Item(f"x{c}", 1101, "x", 1100) for c in range(4)]
    assert not any(b.tree for b in drain(TokenPacker(), too_long, limits))
    many = [Item(f"m{g}i{i}", 60 + 30, f"m{g}", 60) for g in range(4) for i in range(20)]  # 660 slots, mostly suffixes
    assert not any(b.tree for b in drain(TokenPacker(), many, limits))
    capped = drain(TokenPacker(TokenBatching(packed_row_tokens=512)), long, limits)
    assert not any(b.tree for b in capped)


def test_draining_the_last_short_rows_join_the_batch_when_a_batch_of_their_own_costs_more():
    """One 250-slot unit left after a 480-slot one: its own batch would cost a step (256 slots) plus
    256 slots, more than padding it to 480 here; with no step cost it runs apart."""
    items = _groups([(400, 4), (170, 4)])
    assert _tree_shapes(drain(TokenPacker(TokenBatching(batch_overhead_tokens=256)), items)) == [(2, 480)]
    assert sorted(_tree_shapes(drain(TokenPacker(TokenBatching(batch_overhead_tokens=0)), items))) == [
        (1, 256),
        (1, 480),
    ]


def test_the_rows_that_pay_cost_no_more_than_full_batches_of_the_longest(monkeypatch):
    """Random small prefix groups over random limits and step costs, drained through the scheduler:
    taking only the rows that pay never costs more than 0.5% over filling each batch in order (the
    rule before), and less in total; every item runs once within the limits."""
    import random

    from forge.batching.merged import MergedPlanning
    from forge.vocab.geometry import step_cost

    pay = MergedPlanning._rows_that_pay
    rng = random.Random(0)
    totals = [0, 0]
    for _ in range(40):
        limits = Limits(rng.choice([2048, 4096, 8192]), rng.choice([16, 64, 256]), 2048, rng.choice([1, 8, 64]))
        overhead = rng.choice([0, 64, 256, 1024])
        units = [(rng.randint(10, 400), rng.randint(1, 30)) for _ in range(rng.randint(5, 80))]
        items = [
            Item(f"g{g}i{i}", p + rng.randint(1, 40), f"p{g}", p) for g, (p, n) in enumerate(units) for i in range(n)
        ]
        rng.shuffle(items)
        costs = []
        for rule in (lambda self, rows, used, row, n_rows, device: list(range(min(n_rows, len(rows)))), pay):
            monkeypatch.setattr(MergedPlanning, "_rows_that_pay", rule)
            batches = drain(TokenPacker(TokenBatching(batch_overhead_tokens=overhead)), items, limits)
            assert Counter(it.id for b in batches for it in b.items) == Counter(it.id for it in items)
            assert all(broken_limit(b, limits) is None for b in batches)
            costs.append(sum(overhead + step_cost(b).tokens for b in batches))
        assert costs[1] <= costs[0] * 1.005
        totals = [t + c for t, c in zip(totals, costs)]
    assert totals[1] < totals[0]


# -- exactness -------------------------------------------------------------------------------


def _spy(monkeypatch):
    """Records, per tree batch the runner lays out, how many prefix spans each row holds."""
    import forge.runtime.forward.causal_lm as cl

    seen = []
    real = cl.tree_layout

    def spy(rows, seqs, root=0):
        layout = real(rows, seqs, root)
        seen.append([sum(1 for span in layout.spans if span[0] == r) for r in range(len(rows))])
        return layout

    monkeypatch.setattr(cl, "tree_layout", spy)
    return seen


FORCE = "batching.batch_overhead_tokens=100000"  # a step costs so much that every small group merges
MERGED = {
    "token-merged": ["batching=token", FORCE],
    "token-merged-packed": ["batching=token", "batching.packing=packed", FORCE],
    "memory-merged": ["batching=memory", "devices.cpu_memory_gb=0.03", FORCE],
}
LIMITS_ARGS = [
    "devices=auto",
    "devices.limits.max_batch_tokens=768",
    "devices.limits.max_seq_len=384",
    "devices.limits.max_rows=2",  # two rows fill a step: rows as long as max_seq_len, holding several groups
    "budget.tokens_per_step=768",
]


@pytest.fixture(scope="module")
def few_shot_rows():
    from test_token_states import held_out_rows

    rows = held_out_rows()
    for j, r in enumerate(rows):  # six prefixes of 60..95 characters: many small groups
        if "prefix" in r:
            r["prefix"] = r["prefix"][: 60 + 7 * (j % 6)]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean", "none"])
def test_probe_gen_tree_rows_equal_one_prompt_at_a_time(tmp_path, monkeypatch, few_shot_rows, pooling):
    seen = _spy(monkeypatch)
    extra = ["storage_dtype=float32", "prefix_states=none"] if pooling == "none" else []
    found = check_modes(
        "probe_gen",
        few_shot_rows,
        tmp_path,
        tol=1e-4,
        overrides=[f"pooling={pooling}", "layers=[0,2,4]", *extra],
        modes=MERGED,
        limits=LIMITS_ARGS,
    )
    assert not found.refused
    assert max(found.worst.values()) < 1e-4
    assert seen and max(max(rows) for rows in seen) >= 2  # rows held several prefixes


@pytest.mark.slow
def test_score_tree_rows_equal_one_prompt_at_a_time(tmp_path, monkeypatch):
    from forge.functions.assets import embedded_dataset_path

    seen = _spy(monkeypatch)
    path = embedded_dataset_path().with_name("multiple_choice.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()[:24]]
    found = check_modes(
        "score",
        rows,
        tmp_path,
        tol=1e-4,
        modes={"token": ["batching=token"]},  # the defaults merge these questions on their own
        limits=["devices=auto", "devices.limits.max_batch_tokens=2048", "devices.limits.max_seq_len=1024"],
    )
    assert not found.refused and found.worst["token"] < 1e-4
    assert len(seen) >= 2
    got, want = found.results["token"].columns, found.reference.columns
    assert list(got["greedy"]) == list(want["greedy"])


@pytest.mark.slow
def test_few_shot_contexts_past_the_shared_row_run_alone_after_their_root_and_equal_one_prompt_at_a_time(
    tmp_path, monkeypatch
):
    """MMLU's shape at the default batching and at batching=memory: five shots, then a question,
    over 512 tokens in all, and the letters scored. Each question takes a tree row alone, after
    the shots' root."""
    import random

    seen, roots = [], []
    import forge.runtime.forward.causal_lm as cl

    real = cl.tree_layout

    def spy(rows, seqs, root=0):
        layout = real(rows, seqs, root)
        seen.append([sum(1 for span in layout.spans if span[0] == r) for r in range(len(rows))])
        roots.append(root)
        return layout

    monkeypatch.setattr(cl, "tree_layout", spy)
    pick = random.Random(7)
    vocab = "cell river stone argue quiet metal orbit seven lemon trade north clock paper value".split()

    def question(k: int) -> str:
        text = " ".join(pick.choice(vocab) for _ in range(24))
        return text + "".join(f"\n{c}. " + " ".join(pick.choice(vocab) for _ in range(4)) for c in "ABCD")

    shots = "".join(f"{question(k)}\nAnswer: {'ABCD'[k % 4]}\n\n" for k in range(5))
    questions = [question(100 + q) for q in range(6)]
    rows = [
        {"id": f"q{q}{c}", "context": f"{shots}{text}\nAnswer:", "continuation": f" {c}"}
        for q, text in enumerate(questions)
        for c in "ABCD"
    ]
    found = check_modes(
        "score",
        rows,
        tmp_path,
        tol=1e-4,
        modes={"token": ["batching=token"], "memory": ["batching=memory"]},
        limits=["devices=auto", "devices.limits.max_batch_tokens=8192", "devices.limits.max_seq_len=2048"],
    )
    assert not found.refused and found.worst["token"] < 1e-4 and found.worst["memory"] < 1e-4
    assert seen and all(n == 1 for rows_ in seen for n in rows_) and sum(len(r) for r in seen) == 12  # 6 a mode
    assert min(roots) >= 256  # the shots ran once, as the root
    for mode in ("token", "memory"):
        assert list(found.results[mode].columns["greedy"]) == list(found.reference.columns["greedy"])


def test_the_plot_draws_each_prefix_once_per_tree_row():
    from forge.cli.plot import PREFIX, _rows

    trees = [b for b in drain(TokenPacker(), questions(60)) if b.tree]
    drawn = _rows(trees[:1])
    for row, segs in zip(trees[0].rows, drawn):
        assert sum(n for n, _ in segs) == trees[0].padded_len  # prefixes, suffixes and padding fill the row
        assert sum(1 for _, colour in segs if colour == PREFIX) == len(runs(row))


def test_a_root_is_the_prefixes_common_start_cut_to_blocks_short_of_each_prefix():
    import torch

    from forge.runtime.forward.tree_root import ROOT_BLOCK, root_length

    shots = torch.arange(100, 170)  # 70 tokens every prefix starts with

    def item(name, own_prefix, suffix=3):
        seq = torch.cat([shots, torch.tensor(own_prefix, dtype=torch.long), torch.arange(9, 9 + suffix)])
        return Item(name, seq.numel(), f"p-{own_prefix}", 70 + len(own_prefix)), seq

    items, seqs = zip(*[item("a", [1, 2]), item("b", [1, 2]), item("c", [5, 6, 7])])
    assert root_length(list(items), list(seqs)) == 64  # 70 shared, cut to a multiple of 16
    assert 64 % ROOT_BLOCK == 0
    # a prefix of 40 tokens: its last token stays in the row (39 -> 32)
    short = Item("s", 43, "p-short", 40)
    assert root_length([short], [torch.arange(100, 143)]) == 32
    # under 32 tokens in common, or an item without a prefix: no root
    other = torch.cat([torch.arange(100, 120), torch.arange(500, 560)])
    assert root_length([items[0], Item("o", 80, "p-o", 75)], [seqs[0], other]) == 0
    assert root_length([items[0], Item("n", 5)], [seqs[0], torch.arange(5)]) == 0


def test_tree_rows_after_a_root_account_every_prefix_token_once():
    from forge.vocab.geometry import Batch
    from forge.vocab.records import batch_stats

    rows = [
        [Item("a", 90, "p1", 80), Item("b", 85, "p1", 80)],
        [Item("c", 75, "p2", 70)],
    ]
    batch = Batch(rows=rows, padded_len=184, split_prefix=False, packed=True, tree=True)
    plain = batch_stats(batch, 1.0, 0)
    assert (plain.prefix_computed_tokens, plain.cache_hit_tokens, plain.shared_tokens) == (150, 0, 80)
    ran = batch_stats(batch, 1.0, 64, root_held_tokens=2 * 64)  # the root ran now: shared by both spans
    hit = batch_stats(batch, 1.0, 0, root_held_tokens=2 * 64)  # the root came from the cache
    assert (ran.prefix_computed_tokens, ran.cache_hit_tokens, ran.shared_tokens) == (150 - 128 + 64, 0, 80 + 64)
    assert (hit.prefix_computed_tokens, hit.cache_hit_tokens, hit.shared_tokens) == (150 - 128, 128, 80)
    for s in (plain, ran, hit):
        assert s.prefix_computed_tokens + s.cache_hit_tokens + s.shared_tokens == batch.prefix_tokens
    assert ran.padded_slots == batch.padded_slots + 64


def test_the_prefix_cache_finds_the_longest_held_start_of_a_prefix_in_whole_blocks():
    import torch

    from forge.runtime.forward.prefix_cache import START_BLOCK, PrefixCache, PrefixEntry

    def entry(tokens):
        kv = [(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))]
        return PrefixEntry(kv, len(tokens), tokens=torch.tensor(tokens))

    shots = list(range(100, 150))  # 50 tokens: three whole blocks
    cache = PrefixCache(1000)
    cache.put((None, "q1"), entry(shots + [1, 2, 3]))
    found = cache.longest_start(None, torch.tensor(shots + [7, 8, 9, 10]), 53)
    assert found is not None and found[1] == 3 * START_BLOCK and found[0].length == 53
    assert cache.longest_start(None, torch.tensor(shots), 40)[1] == 2 * START_BLOCK  # at most `most` tokens
    assert cache.longest_start("steered", torch.tensor(shots), 50) is None  # another tag's keys
    assert cache.longest_start(None, torch.tensor([9] + shots), 50) is None  # differs in the first block
    cache.put((None, "other"), entry(list(range(900, 1900))[:990]))  # evicts q1: its starts go with it
    assert (None, "q1") not in cache and cache.longest_start(None, torch.tensor(shots), 50) is None
