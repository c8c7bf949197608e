"""Continuous batching: a set of prompts decoded step by step under a tokens-per-step budget.

Model: the loop is schedule -> run -> update. Each step carries at most ``tokens_per_step`` tokens:
one decode token per running sequence (all in one forward pass over their rows,
`forge.runtime.decoder.rows_kv`, or slots, `forge.runtime.decoder.kv_slots`), then, within what is
left, the next chunk of a block of waiting prompts being prefilled (`forge.runtime.decoder.prefill`,
in parts of prompts that compute about as many columns each). A prompt block is formed when none is
in progress: the next waiting prompts by their own length (past their prefix), as many as the step's
room allows; the prefixes among them not stored yet are computed first, once each (one forward pass
of their own), and kept for the worker's later blocks and batches (a `PrefixCache`). When its last
chunk is done, each prompt gets its first token and, unless that ends it, a slot. A sequence leaves
its slot the step it finishes (eos, a stop string, its ``max_new_tokens``), and the slot is free for
the next block.

A sequence never waits on another's length or padding for its result: its columns and position ids
are its own, so greedy decoding equals one-prompt-at-a-time `generate` (tests/test_generate.py);
sampling draws from the sequence's own stream (`Sampling`). Where the model allows it
(`forge.runtime.forward.shared_prefix.install`), Forge's attention computes every forward pass: a
prompt after a stored prefix prefills only its own tokens, decode steps read each shared prefix's KV once for all
its sequences, and each sequence has a left-aligned row of its own tokens that attention reads at
its own length (`RowKV`: it grows without moving others). Other models keep right-aligned slots
under a mask, the prefix seeded into each prompt's first columns (`SlotKV`). Under a KV budget, what
a block takes, whether it is admitted and who is preempted is asked of
`forge.runtime.decoder.admission.KVBudget`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from forge.runtime.decoder.admission import KVBudget, renumber
from forge.runtime.decoder.heap import release_free_heap
from forge.runtime.decoder.kv_slots import SlotKV
from forge.runtime.decoder.prefill import (
    PREFIX_TOKENS,
    BlockPrefill,
    Prefill,
    Steer,
    forward,
    steered,
)
from forge.runtime.decoder.rows_kv import RowKV
from forge.runtime.decoder.sampling import Sampling
from forge.runtime.decoder.sequence import DecodeFigures, Sequence, least_kv_bytes, step_slots
from forge.runtime.forward import shared_prefix
from forge.runtime.forward.prefix_cache import PrefixCache, PrefixEntry, PrefixKey
from forge.runtime.model.hf_compat import input_device

__all__ = ["DecodeFigures", "Decoder", "Sequence", "least_kv_bytes"]


class Decoder:
    """A loaded causal LM generating sets of prompts; shared prefixes' KV is kept across calls."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        tokens_per_step: int,
        eos: set[int],
        pad_token_id: int,
        sampling: Sampling | None = None,
        prefix_tokens: int = PREFIX_TOKENS,
        shared_attention: bool = True,
        kv_bytes: int | None = None,
        max_running: int | None = None,
        steer: tuple[Any, str | None] | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.budget = int(tokens_per_step)
        self.max_running = self.budget if max_running is None else min(self.budget, int(max_running))
        # the interventions' hooks (a forge.runtime.hooks.points.HookSet) and what tags the prefixes they change:
        # a prefix's KV is stored under (tag, its tokens), so a steered one never serves an unsteered one
        self.hooks: Any = steer[0] if steer is not None else None
        self.tag: str | None = steer[1] if steer is not None else None
        self.eos, self.pad = eos, int(pad_token_id)
        self.sampling = sampling if sampling is not None and not sampling.greedy else None  # None: greedy
        self.layers = int(model.config.get_text_config().num_hidden_layers)
        self.prefixes = PrefixCache(prefix_tokens, None if kv_bytes is None else kv_bytes // 4)  # a quarter at most
        self.kv_bytes = kv_bytes  # what keys and values may hold at once: slots, prefills, prefixes (None: no limit)
        # Forge's attention for every pass (sdpa itself outside decode steps and prefills after stored prefixes)
        self.shared_attention = shared_attention and shared_prefix.install(model) is None
        self._stacked: tuple | None = None  # (prefixes' ids, their stacked KV, valid, the prefixes)
        self._ended: list[Sequence] = []  # sequences that ended in the step being run
        self.table: Any = None  # the call's per-item intervention parameters (forge.runtime.hooks.row_tables)
        self.admission = KVBudget(kv_bytes, self.prefixes, self._key, self._drop_stacked)  # admission, preemption

    def generate(self, seqs: list[Sequence], on_finished: Any = None, table: Any = None) -> DecodeFigures:
        """Generate every sequence to its end (their `out` filled). `on_finished(seqs)`: called
        after each step with the sequences that ended in it (their output final), if any. `table`:
        the per-item parameters of row-dependent interventions (`forge.runtime.hooks.row_tables.RowTables`
        of the items the sequences' `index` names)."""
        self._ended, self.table = [], table
        try:
            with torch.inference_mode():
                return self._generate(seqs, on_finished)
        finally:
            self.table = None

    def _generate(self, seqs: list[Sequence], on_finished: Any) -> DecodeFigures:
        waiting = deque(sorted(seqs, key=lambda s: len(s.prompt) - s.prefix_len))  # a block's: similar own lengths
        # Forge's attention reads each row's own length: left-aligned rows; else right-aligned slots under a mask
        kv: Any = (RowKV if self.shared_attention else SlotKV)(self.layers, input_device(self.model))
        if self.kv_bytes is None:
            kv.reserve(min(len(seqs), self.budget), max(len(s.prompt) + s.max_new_tokens for s in seqs))
        else:
            self._shape(kv)
        running: dict[int, Sequence] = {}
        prefix_fill: Prefill | None = None  # the block's prefixes not stored yet, computed first
        keys: list[PrefixKey] = []
        block: list[Sequence] = []
        fill: BlockPrefill | None = None  # the block's prefill, once its prefixes are known
        figures = DecodeFigures([], 0)
        figures.prefix_stored_tokens = sum(s.prefix_len for s in seqs if self._key(s) in self.prefixes)
        while waiting or block or running:
            if running and self.kv_bytes is not None:
                for seq in self.admission.make_room(kv, running, waiting, self.admission.other_bytes(kv, block, fill)):
                    figures.preempted += 1
                    figures.recomputed_tokens += len(seq.out)
            tokens = self._decode(kv, running) if running else 0
            figures.decode_tokens += tokens
            room = self.budget - tokens
            if not block and waiting and room > 0 and len(running) < self.max_running:
                block, prefix_fill, keys, hit = self._schedule(waiting, self.max_running - len(running), kv, running)
                figures.prefix_hits += hit
            if prefix_fill is not None and room >= len(keys):
                used = prefix_fill.run(room)
                tokens, room = tokens + used, room - used
                if prefix_fill.finished:
                    held = {self._key(s) for s in block}  # the block's prompts start after them
                    for g, key in enumerate(keys):
                        kv_g = [(k[None].clone(), v[None].clone()) for k, v in prefix_fill.kv(g)]
                        self.prefixes.put(key, PrefixEntry(kv_g, len(key[1])), keep=held)
                    prefix_fill, self.admission.computing_bytes = None, 0
                    release_free_heap()  # their prefill's cache and transients
            if block and prefix_fill is None and fill is None:
                prefixes = [self._stored(s) for s in block]
                shared = self._prefill_step if self.shared_attention else None
                fill = BlockPrefill(
                    self.model, [s.tokens() for s in block], self.layers, self.pad, prefixes, self._steer(block), shared
                )
            if fill is not None and not fill.finished:
                tokens += fill.run(room)
            if fill is not None and fill.finished and self.admission.admits(kv, running, block, fill):
                self._admit_block(kv, running, block, fill, len(figures.steps))
                figures.prefill_pads += fill.slots_run - fill.tokens_run
                block, fill = [], None
                release_free_heap()  # the block's caches and transients, freed: not held to the run's end
            figures.steps.append(tokens)
            self._note(kv, block, fill)
            if self._ended:
                ended, self._ended = self._ended, []
                if on_finished is not None:
                    on_finished(ended)
        figures.kv_peak_bytes = kv.peak_bytes
        figures.kv_held_peak_bytes = getattr(kv, "held_peak_bytes", 0)
        return figures

    def _admit_block(self, kv: Any, running: dict[int, Sequence], block: list[Sequence], fill: BlockPrefill,
                     step: int) -> None:  # fmt: skip
        """A finished block's prompts each get their first token, and a row or slot if they go on;
        each part's cache is dropped once its prompts have theirs."""
        if isinstance(kv, RowKV) and self.kv_bytes is None and kv.column_bytes:  # the rows of all parts at once
            kv.make_room(len(block), max(max(part.lens) for _, part in fill.parts))
        for rows, part in fill.parts:
            seqs, skipped = [block[g] for g in rows], [fill.skipped[g] for g in rows]
            if isinstance(kv, RowKV):
                self._admit_rows(kv, running, part, seqs, skipped, step, block, fill)
            else:
                self._admit(kv, running, part, seqs, step, block, fill)
            part.drop_cache()
        self._note(kv, block, fill)

    def _note(self, kv: Any, block: list[Sequence], fill: BlockPrefill | None) -> None:
        """What keys and values are held now (rows' layout): the rows' tokens, stored and stacked
        prefixes, the block's prefill cache; against what is allocated for them."""
        if not isinstance(kv, RowKV):
            return
        stored = self.prefixes.bytes
        stacked = self.admission.stacked_bytes
        prefill = 0 if fill is None else fill.held_columns() * kv.column_bytes
        tokens = 0 if fill is None else sum(len(s.tokens()) - k for s, k in zip(block, fill.skipped)) * kv.column_bytes
        shared = stacked if stacked else stored  # the stored prefixes are views into the stack once stacked
        kv.note_held(shared + tokens, shared + prefill)

    def _stored(self, seq: Sequence) -> Any:
        """The stored KV of `seq`'s prefix, or None."""
        entry = self.prefixes.peek(self._key(seq))
        return None if entry is None else entry.key_values

    def _key(self, seq: Sequence) -> PrefixKey:
        return self.prefix_key(seq.prompt, seq.prefix_len, seq.prefix_tag)

    def prefix_key(self, tokens: Any, prefix_len: int, row_tag: Any = None) -> PrefixKey:
        """What a prefix's KV is stored under: the interventions' tag (None: no steering reaches a
        prefix token), with `row_tag` (what a sequence's own intervention parameters change in its
        prefix, `Sequence.prefix_tag`) where given, and its tokens."""
        tag = self.tag if row_tag is None else (self.tag, row_tag)
        return tag, tuple(int(t) for t in tokens[:prefix_len])

    def _steer(self, seqs: list[Sequence]) -> Steer | None:
        """For a prefill of these sequences: the hooks, where each one's own and generated tokens
        start, and its item's parameters."""
        if self.hooks is None:
            return None
        return Steer(self.hooks, [(s.prefix_len, len(s.prompt)) for s in seqs], [s.index for s in seqs], self.table)

    def _schedule(self, waiting: deque, room: int, kv: SlotKV, running: dict[int, Sequence]):
        """The next block: at most `room` waiting prompts (each step then has a token for each), as
        many as the KV budget holds beside what runs; and one forward pass of the prefixes whose KV
        is not stored, first (computed once: the block's prompts then start after them, and later
        blocks and batches find them stored).
        Returns (block, the prefixes' prefill or None, their keys, prefixes found stored)."""
        take = min(len(waiting), room)
        if self.kv_bytes is not None:
            take = self.admission.fitting(waiting, take, kv, running)
        block = [waiting.popleft() for _ in range(take)]
        keys = [k for k in dict.fromkeys(self._key(s) for s in block) if k[1]]
        missing = [k for k in keys if self.prefixes.get(k) is None]
        if not missing:
            return block, None, [], len(keys)
        holder = {self._key(s): s.index for s in reversed(block)}  # a sequence of each prefix: whose parameters
        steer = None if self.hooks is None else Steer(self.hooks, None, [holder[k] for k in missing], self.table)
        fill = Prefill(self.model, [list(k[1]) for k in missing], self.layers, self.pad, [None] * len(missing), steer)
        self.admission.computing_bytes = sum(len(k[1]) for k in missing) * kv.column_bytes
        return block, fill, missing, len(keys) - len(missing)

    def _admit(self, kv: SlotKV, running: dict[int, Sequence], fill: Prefill, block: list[Sequence], step: int,
               whole: list[Sequence], whole_fill: BlockPrefill):  # fmt: skip
        """Each prompt of a part (`fill`, its prompts `block`) gets its first token, and a slot if it
        goes on, its whole prompt in the slot (right-aligned slots: models Forge's attention does not
        compute). `whole`, `whole_fill`: the block and its prefill, held meanwhile."""
        assert fill.last_logits is not None  # a finished prefill
        tokens = self._choose(fill.last_logits, block)
        go = [g for g, (seq, token) in enumerate(zip(block, tokens)) if not self._take(seq, token)]
        if not go:
            return
        index = torch.tensor(go, dtype=torch.long)  # on the CPU: it indexes KV on every layer's device
        every = len(go) == len(block)
        rows = [(k, v) if every else (k[index], v[index]) for k, v in fill.layer_kv()]
        mask = fill.mask[index].clone()
        positions = torch.tensor([len(block[g].tokens()) - 1 for g in go], device=kv.device)
        if self.kv_bytes is not None:
            self.admission.bound(kv, self.admission.other_bytes(kv, whole, whole_fill))
        for g, slot in zip(go, kv.place(rows, mask, positions)):
            block[g].slot, block[g].admitted = slot, step
            running[slot] = block[g]

    def _admit_rows(self, kv: RowKV, running: dict[int, Sequence], fill: Prefill, block: list[Sequence],
                    skipped: list[int], step: int, whole: list[Sequence], whole_fill: BlockPrefill):  # fmt: skip
        """Each prompt of a part gets its first token, and a row if it goes on: its computed tokens
        (those past a prefix read apart, `skipped`), left-aligned."""
        assert fill.last_logits is not None  # a finished prefill
        tokens = self._choose(fill.last_logits, block)
        go = [g for g, (seq, token) in enumerate(zip(block, tokens)) if not self._take(seq, token)]
        if not go:
            return
        index = torch.tensor(go, dtype=torch.long)  # on the CPU: it indexes KV on every layer's device
        rows = fill.layer_kv() if len(go) == len(block) else [(k[index], v[index]) for k, v in fill.layer_kv()]
        for g in go:
            if skipped[g]:
                block[g].prefix_kv = self._stored(block[g])
        positions = torch.tensor([len(block[g].tokens()) - 1 for g in go], device=kv.device)
        if self.kv_bytes is not None:
            self.admission.bound(kv, self.admission.other_bytes(kv, whole, whole_fill))
        placed = kv.place(rows, [fill.pads[g] for g in go], [fill.lens[g] for g in go], positions)
        for g, slot in zip(go, placed):
            block[g].slot, block[g].admitted = slot, step
            running[slot] = block[g]

    def _shape(self, kv: SlotKV) -> None:
        """The slots' column bytes before the first block, from one token's keys and values."""
        probe = Prefill(self.model, [[self.pad]], self.layers, self.pad, [None])
        probe.run(1)
        kv.shape_like(probe.layer_kv())

    def _drop_stacked(self) -> None:
        self._stacked = None

    def _decode(self, kv: SlotKV, running: dict[int, Sequence]) -> int:
        """One decode step of every running sequence; returns its tokens."""
        kv.before_step()
        ids = torch.full((kv.slots, 1), self.pad, dtype=torch.long, device=kv.device)
        slots = list(running)
        ids[slots, 0] = torch.tensor([running[s].out[-1] for s in slots], device=kv.device)
        if self.shared_attention:
            own = {slot: seq.prefix_kv for slot, seq in running.items() if seq.prefix_kv is not None}
            shared_prefix.SHARED.step = self._step(own, kv.device, getattr(kv, "keep", None))
        args = (self.model, ids, kv.step_mask(), kv.positions[:, None].clone(), kv.cache)
        try:
            logits = (
                forward(*args)
                if self.hooks is None
                else steered(self.hooks, step_slots(kv.positions, running, self.table), *args)
            )
        finally:
            shared_prefix.SHARED.step = None
        kv.after_step()
        seqs = [running[s] for s in slots]
        for slot, seq, token in zip(slots, seqs, self._choose(logits[slots], seqs)):
            if self._take(seq, token):
                kv.release(slot)
                del running[slot]
        renumber(running, kv.tidy())
        return len(slots)

    def _prefill_step(self, prefixes: list[Any]) -> shared_prefix.Step | None:
        """A prefill part's step: its rows after a stored prefix read it apart (None: no row does)."""
        readers = {r: kv for r, kv in enumerate(prefixes) if kv is not None}
        return self._step(readers, input_device(self.model), None) if readers else None

    def _step(self, readers: dict[int, Any], device: Any, own: Any) -> shared_prefix.Step | None:
        """The shared prefixes `readers` (row -> its prefix's KV) read, stacked once while the stack
        holds them all (the stored entries become views into it: the stack is their storage)."""
        if not readers:
            if own is None:
                return None
            none = torch.zeros(0, dtype=torch.long, device=device)
            return shared_prefix.Step([], none.bool(), none, none, none, 0, own)
        by: dict[int, list[int]] = {}
        kvs: dict[int, Any] = {}
        for row, kv in readers.items():
            by.setdefault(id(kv), []).append(row)
            kvs[id(kv)] = kv
        held = self._stacked
        if held is None or not set(by) <= set(held[0]) or len(held[0]) > 2 * len(by):
            key = tuple(sorted(by))
            read = [kvs[k] for k in key]  # kept in `_stacked`: an id there is never a freed object's reused one
            for kv in held[3] if held is not None else ():  # the old stack's other prefixes: storage of their own,
                if id(kv) not in by:  # so the old stack is freed (not held whole for a few of its prefixes)
                    kv[:] = [(k.clone(), v.clone()) for k, v in kv]
            self._stacked = held = None  # the old stack is freed layer by layer as the new one adopts its prefixes
            # in place: a sequence's `prefix_kv` is the same list as the store's entry
            layers, valid = shared_prefix.stack(read, adopt=True, each_layer=release_free_heap)
            self._stacked = held = (key, layers, valid, read)
            self.admission.stacked_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in layers)
        at = {k: g for g, k in enumerate(held[0])}
        rows: list[int] = []
        group: list[int] = []
        place: list[int] = []
        for k, members in by.items():
            rows += members
            group += [at[k]] * len(members)
            place += range(len(members))
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        width = max(len(m) for m in by.values())
        return shared_prefix.Step(held[1], held[2], t(rows), t(group), t(place), width, own)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if self.sampling is None:
            return logits.argmax(-1).tolist()
        out = []
        for row, seq in zip(logits, seqs):
            assert seq.rng is not None, "a sampled sequence has its own stream (Sampling.stream)"
            out.append(self.sampling.draw(row, seq.rng))
        return out

    def _take(self, seq: Sequence, token: int) -> bool:
        """Append the token; True when it ends the sequence."""
        seq.out.append(int(token))
        done = len(seq.out) >= seq.max_new_tokens or token in self.eos
        if not done and seq.stop:
            text = self.tokenizer.decode(seq.out, skip_special_tokens=True)
            done = any(s in text for s in seq.stop)
        seq.finished = done
        if done:
            self._ended.append(seq)
        return done
