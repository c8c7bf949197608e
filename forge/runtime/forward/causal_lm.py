"""Run one `forge.vocab.geometry.Batch` through a Hugging Face causal LM; return pooled hidden states.

Three row layouts (see `Batch`):

a. ``split_prefix=False, packed=False``: one item per row, whole sequence, right padded,
   2D attention mask, positions 0..len-1 (transformers applies any sliding window itself).
b. ``split_prefix=True, packed=False``: the shared prefix runs once (1 row) or comes from
   the per-device `PrefixCache`; rows hold suffixes, positions P..P+len-1. Where it is exact
   and pays, the rows attend to one copy of the prefix's keys (`forge.runtime.forward.shared_prefix`);
   otherwise they run on a fresh KV cache expanded to B rows, with a 2D mask over prefix +
   suffix, or, for models with sliding windows, 4D masks per layer type (`forge.runtime.forward.masks`).
c. ``split_prefix=True, packed=True`` (also ``split_prefix=False, packed=True``): several
   suffixes end to end in a row; 4D additive masks (each token sees the prefix and earlier
   tokens of its own item, within its layer's window; padding sees the prefix and earlier
   padding), positions restart at P for each item.
d. ``tree=True`` (packed, not split): rows of prefix groups, each prefix once in the row and
   its items' suffixes after it (`forge.runtime.forward.tree_rows`); the same 4D masks, where a
   suffix also sees its prefix's span, and positions restart at 0 for each prefix. A root that
   every prefix starts with runs apart, once, from the cache (`forge.runtime.forward.tree_root`).

Only the base decoder runs (no LM head). Results equal a plain one-prompt-at-a-time
forward pass (`forge.runtime.forward.reference`) up to float rounding; layouts that cannot
(`forge.runtime.model.capabilities`) are refused.

Facts this relies on (transformers 5.x, checked in tests/test_causal_lm.py and tests/test_fidelity.py):
- the cache keyword is ``cache=`` (``past_key_values=`` on 4.x); the forward pass grows the cache object
  it is given, so a stored KV is never handed over itself;
- a cache built with the model's config trims sliding layers to window-1 keys: prefixes use a
  config-less cache that keeps every key, and the masks apply the windows;
- the 2D mask of a cached forward pass must cover prefix + suffix, (B, P+S);
- a 4D mask (hybrid models: {layer type: 4D mask}) passes `create_causal_mask` unchanged to sdpa/eager;
- ``output_hidden_states=[i, j]`` keeps only those indices (others are None).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from forge.runtime.forward import prefix_run, shared_prefix, tree_root
from forge.runtime.forward.items import check_batch_items, resolve_layers, token_tensor
from forge.runtime.forward.masks import additive_masks
from forge.runtime.forward.outputs import PooledOutput, RowStates
from forge.runtime.forward.pooling import pool_states
from forge.runtime.forward.prefix_cache import PrefixCache, PrefixEntry
from forge.runtime.forward.reference import POOLINGS as _POOLINGS
from forge.runtime.forward.tree_rows import NO_CONTEXT, prefix_places, tree_layout, write_prefix_spans
from forge.runtime.hooks import points as hooks, row_tables
from forge.runtime.model import hf_compat
from forge.runtime.model.capabilities import Capabilities, capabilities
from forge.runtime.model.hf_compat import num_layers, text_config
from forge.vocab.geometry import Batch, Item


class CausalLMRunner:
    """Runs `Batch`es through a causal LM's base decoder and pools hidden states.

    `model` is a loaded `AutoModelForCausalLM` in eval mode, on `device` (None: where it is;
    else it moves there once cut, so that the layers cut never reach the device; `place(model)`,
    when given, places it over several devices instead, once cut). `layers` are
    hidden-state indices (0 = embeddings, num_layers = final normed output). `cache_tokens`
    sizes the per-device prefix KV cache (0 = off). `stop_after_deepest`: run `layers_run` layers,
    one past the deepest index asked for, for a function that needs no more."""

    def __init__(
        self,
        model: Any,
        *,
        layers: list[int],
        pooling: str = "last",
        cache_tokens: int = 0,
        pad_token_id: int = 0,
        caps: Capabilities | None = None,
        allow_no_layers: bool = False,
        stop_after_deepest: bool = False,
        device: str | None = None,
        place: Any = None,
        captures: list[str] = (),  # type: ignore[assignment]
        interventions: Any = None,
    ) -> None:
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {_POOLINGS}, got {pooling!r}")
        self.model = model
        self.config = model.config
        self.pooling = pooling
        self.pad_token_id = int(pad_token_id)
        self.num_layers = num_layers(self.config)
        self.layers = list(layers)
        self._layer_idx = resolve_layers(self.layers, self.num_layers, allow_no_layers)
        self._hs_select = sorted(set(self._layer_idx))
        self.cache = PrefixCache(cache_tokens)
        # the interventions' tag in every cache key (None: none reaches a prefix token), as the decoder's
        self.tag: str | None = getattr(interventions, "key", None)
        self.encoder_decoder = bool(getattr(self.config, "is_encoder_decoder", False))
        # an encoder-decoder is unusable: run() refuses it with a clear message
        self.base = model if self.encoder_decoder else hf_compat.base_decoder(model)
        # later layers change no state asked for (captures alone: the layers they read)
        keep = hf_compat.layers_to_run(self._hs_select, self.num_layers) if self._hs_select or not captures else 0
        keep = max(keep, hooks.layers_read(model, self.base, self.num_layers, captures))
        have = getattr(
            model, hf_compat.LOADED_LAYERS, self.num_layers
        )  # fewer: loaded cut (forge.runtime.placement.dispatch)
        if have < (keep if stop_after_deepest else self.num_layers):
            raise ValueError(
                f"the model was loaded with {have} of its {self.num_layers} layers, too few; plan it again"
            )
        cut = stop_after_deepest and (have == keep or hf_compat.keep_first_layers(self.base, have, keep))
        self.layers_run = keep if cut else self.num_layers
        ivs = list(getattr(interventions, "items", interventions or ()))
        self.hooks = hooks.HookSet(model, self.base, self.num_layers, list(captures), ivs)
        patches = self.hooks.patch_points  # patch sources run alone (forge.runtime.hooks.row_tables)
        self.sources = row_tables.SourceValues(model, self.base, self.num_layers, patches) if patches else None
        self._table: row_tables.RowTables | None = None  # the running batch's per-item parameters
        if (
            place is not None
        ):  # a device group: accelerate places the cut model by its map (forge.runtime.placement.dispatch)
            place(model)
        elif device is not None:
            model.to(device)
        # where token ids go (a split model's first block); each layer's states and KV stay on its own device
        self.device = hf_compat.input_device(model)
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = int(getattr(text_config(self.config), "hidden_size", 0)) or None
        self.attn_implementation = getattr(self.config, "_attn_implementation", None)
        self._cache_kw = hf_compat.cache_kwarg(self.base)
        if caps is None:
            caps = capabilities(self.config, type(model), self.attn_implementation or "eager")
        elif self.attn_implementation and caps.attn != self.attn_implementation:
            caps = replace(caps, attn=self.attn_implementation, attn_note="as loaded")  # what runs decides
        self.caps = caps
        self.causal = caps.causal and self._is_causal()  # the architecture says so; a probe confirms
        # rows after a cached prefix attend to one copy of its keys where that is exact for the model
        # (`shared_prefix.eligible`; attention patterns need the model's own attention)
        self._share_prefix = not self.hooks.patterns and shared_prefix.eligible(model) is None
        # a prefix runs after the longest start of it the cache holds, and tree rows after a root their
        # prefixes share, where a split prefix is exact and no hook must see the prefix tokens
        self._starts = self.cache.enabled and not self.hooks.active and self.causal and not caps.refusal(True, False)

    def _is_causal(self) -> bool:
        """Config says decoder, and a probe confirms: changing a later token leaves earlier states alone."""
        if self.encoder_decoder or getattr(self.config, "is_causal", True) is False:
            return False
        return hf_compat.probes_causal(self.base, self.config, self.device)

    def _tree_root(self, items: list[Item], seqs: list[torch.Tensor]) -> int:
        """The root a tree batch's prefixes run after, from the cache; 0: none (no cache, hooks, or a model
        whose split prefix is not exact)."""
        return tree_root.root_length(items, seqs) if self._starts and not self.caps.refusal(True, True) else 0

    # -- running

    def run(self, batch: Batch) -> PooledOutput:
        with torch.inference_mode():
            return self._run(batch)

    def _validate(self, batch: Batch, seqs: list[torch.Tensor], items: list[Item]) -> None:
        if self.encoder_decoder:
            raise ValueError(
                f"{type(self.model).__name__} is an encoder-decoder model; the causal LM runner "
                "needs a decoder-only model"
            )
        if (batch.split_prefix or batch.packed) and not self.causal:
            what = "split_prefix" if batch.split_prefix else "packed rows"
            raise ValueError(
                f"{what} needs a causal decoder, but {type(self.model).__name__} is not one "
                "(encoder-only, encoder-decoder or bidirectional); use split_prefix=False, packed=False"
            )
        reason = self.caps.refusal(batch.split_prefix, batch.packed)
        if reason is not None:
            what = "packed rows" if batch.packed else "split_prefix"
            raise ValueError(f"{what} are not exact for {self.caps.family}: {reason}")
        check_batch_items(batch, seqs, items, self.pooling)

    def _prefix_entry(self, prefix_id: Any, prefix: torch.Tensor) -> tuple[PrefixEntry, int]:
        """The KV of the prefix known as `prefix_id` (from the cache, or computed now, after the longest
        start of it the cache holds) and how many of its tokens ran now (0: a hit)."""
        key = (self.tag, prefix_id)
        use_cache = self.cache.enabled and prefix_id is not None
        if use_cache:
            entry = self.cache.get(key)
            if entry is not None:
                if entry.length == prefix.numel() and torch.equal(entry.tokens, prefix):
                    return entry, 0
                # Same key, other tokens: not a usable hit; recompute and replace.
                self.cache.hits -= 1
                self.cache.misses += 1
        start = self.cache.longest_start(self.tag, prefix, prefix.numel() - 1) if self._starts else None
        entry = prefix_run.run_prefix(self, prefix, start)
        if use_cache:
            self.cache.put(key, entry)
        return entry, prefix.numel() - (start[1] if start is not None else 0)

    def _batch_prefix(self, batch: Batch, items: list[Item], seqs: list[torch.Tensor]):
        """(the KV a batch's rows run after: its split prefix, or a tree batch's root (`tree_root`), computed
        once or from the cache; the prefix tokens run for it now, 0 on a hit; the root's length, 0: none)."""
        off = batch.prefix_len if batch.split_prefix else 0
        root = self._tree_root(items, seqs) if batch.tree else 0
        if not off and not root:
            return None, 0, 0
        prefix = seqs[0][: off or root]
        entry, computed = self._prefix_entry(batch.prefix_key if off else tree_root.root_id(prefix), prefix)
        return entry, computed, root

    def _run(self, batch: Batch) -> PooledOutput:
        states = self._forward_batch(batch)
        if states is None:
            h = self.hidden_size or 0
            return PooledOutput({L: torch.empty(0, h) for L in self.layers}, 0, False)
        pooled = pool_states(states, len(batch.items), self.pooling, self.layers, self._layer_idx)
        return PooledOutput(
            pooled=pooled, prefix_computed_tokens=states.prefix_computed_tokens, cache_hit=states.cache_hit
        )

    def forward_tokens(self, batch: Batch) -> RowStates | None:
        """The batch's forward pass, not pooled: the final hidden state of every row token and where
        each token sits (for functions that read per-token states, e.g. scoring). None: an empty batch."""
        with torch.inference_mode():
            return self._forward_batch(batch)

    def _forward_batch(self, batch: Batch) -> RowStates | None:
        items = batch.items
        n = len(items)
        if n == 0:
            return None
        seqs = [token_tensor(it) for it in items]
        self._validate(batch, seqs, items)
        self._table = None
        if self.hooks.row_dependent:  # each item's own intervention parameters (and patch sources)
            sources = self.sources.of(items, self.device) if self.sources is not None else {}
            self._table = row_tables.RowTables(items, self.hooks.interventions, sources)

        split = batch.split_prefix
        packed = batch.packed
        off = batch.prefix_len if split else 0

        entry, prefix_computed, root = self._batch_prefix(batch, items, seqs)
        hit = entry is not None and prefix_computed == 0

        # Row geometry, per item: row, start slot in row, tokens in row, first pooled slot.
        rows = [r for r, row in enumerate(batch.rows) for _ in row]
        layout = tree_layout(batch.rows, seqs, root) if batch.tree else None
        offs = [it.prefix_len for it in items] if layout is not None else [off] * n  # tokens outside each span
        lens_list = [s.numel() - o for s, o in zip(seqs, offs)]
        if layout is not None:
            starts_list, used = layout.starts, layout.used
        else:
            starts_list = []
            used = [0] * len(batch.rows)
            for r, m in zip(rows, lens_list):
                starts_list.append(used[r])
                used[r] += m
        S = int(batch.padded_len)
        if max(used) > S:
            r = max(range(len(used)), key=used.__getitem__)
            raise ValueError(f"row {r} holds {used[r]} tokens but padded_len is {S}")
        if root:  # the rows hold less than the packer laid out: cut them to their longest
            S = min(S, -(-max(used) // 8) * 8)
        keep_rows = [r for r, u in enumerate(used) if u > 0]  # rows with no tokens do not run
        row_map = {r: i for i, r in enumerate(keep_rows)}
        B = len(keep_rows)

        lens = torch.tensor(lens_list, dtype=torch.long)
        starts = torch.tensor(starts_list, dtype=torch.long)
        item_row = torch.tensor([row_map.get(r, -1) for r in rows], dtype=torch.long)
        # First slot (within the item's span in the row) that mean pooling counts.
        item_off = torch.tensor(offs, dtype=torch.long)
        pool_from = (torch.tensor([it.prefix_len for it in items], dtype=torch.long) - item_off).clamp_(min=0)
        prefix_at = prefix_places(layout, row_map) if layout is not None else None

        hidden: dict[int, torch.Tensor] = {}
        captured: dict[str, torch.Tensor] = {}
        last, tok = None, None
        total = int(lens.sum())
        if total > 0:
            hidden, tok, last, captured = self._forward_rows(
                items, seqs, item_off, lens, starts, item_row, B, S, used, keep_rows, entry, packed, layout, row_map
            )
        return RowStates(
            hidden=hidden,
            last=last,
            tok=tok,
            total=total,
            lens=lens,
            starts=starts,
            item_row=item_row,
            pool_from=pool_from,
            item_off=item_off,
            prefix_at=prefix_at,
            entry=entry,
            cache_hit=hit,
            prefix_computed_tokens=prefix_computed,
            captured=captured,
            root_held_tokens=root * len(layout.spans) if root and layout is not None else 0,
        )

    def _forward_rows(
        self, items, seqs, item_off, lens, starts, item_row, B, S, used, keep_rows, entry, packed, layout, rmap
    ):
        dev = self.device
        n = lens.numel()
        total = int(lens.sum())
        flat = torch.cat([s[o:] for s, o in zip(seqs, item_off.tolist())])
        tok_item = torch.repeat_interleave(torch.arange(n), lens)
        item_first = torch.cumsum(lens, 0) - lens
        tok_within = torch.arange(total) - item_first[tok_item]
        tok_row = item_row[tok_item]
        tok_col = starts[tok_item] + tok_within

        input_ids = torch.full((B, S), self.pad_token_id, dtype=torch.long)
        input_ids[tok_row, tok_col] = flat
        off = int(item_off[0]) if layout is None else 0
        position_ids = (off + torch.arange(S, dtype=torch.long)).repeat(B, 1)
        if packed:
            position_ids[tok_row, tok_col] = item_off[tok_item] + tok_within
        P = entry.length if entry is not None else 0
        tok = (tok_item, tok_within, tok_row, tok_col)
        slots = hooks.row_slots(items, tok, B, S, position_ids, table=self._table) if self.hooks.active else None
        out, caught = self._shared(
            entry, packed, [used[r] for r in keep_rows], input_ids.to(dev), position_ids.to(dev), slots
        )
        if out is not None:  # it builds its own masks
            return {i: out.hidden_states[i] for i in self._hs_select}, tok, out.last_hidden_state, caught

        if packed or (P and self.caps.windows):
            # Per-item 4D masks: packed rows keep items apart; sliding windows cut off far prefix keys.
            seg = torch.full((B, S), -1, dtype=torch.long)
            seg[tok_row, tok_col] = tok_item
            ctx = None
            if layout is not None:  # tree rows: each prefix span in the row, seen by its suffixes
                ctx = torch.full((B, S), NO_CONTEXT, dtype=torch.long)
                group = torch.tensor(layout.group_of, dtype=torch.long)
                ctx[tok_row, tok_col] = torch.where(group >= 0, n + group, NO_CONTEXT)[tok_item]
                write_prefix_spans(layout, seqs, rmap, n, input_ids, position_ids, seg, ctx)
                if slots is not None:
                    held = row_tables.span_items(layout, seg, n)
                    slots = hooks.row_slots(items, tok, B, S, position_ids, seg >= n, self._table, held)
            window = self.caps.windows[0] if self.caps.windows else None
            mask = additive_masks(seg, position_ids, P, self.caps.layer_types, window, self.dtype, dev, ctx)
        else:
            used_t = torch.tensor([used[r] for r in keep_rows], dtype=torch.long)
            suffix = (torch.arange(S)[None, :] < used_t[:, None]).long()
            mask = torch.cat([torch.ones(B, P, dtype=torch.long), suffix], dim=1).to(dev)

        kwargs: dict[str, Any] = {}
        if entry is not None:  # a new cache each call, over the stored tensors (the pass grows what it gets)
            kv = [(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) for k, v in entry.key_values]
            kwargs[self._cache_kw] = hf_compat.plain_cache(kv)
            kwargs["use_cache"] = True
        else:
            kwargs["use_cache"] = False
        out, caught = self.hooks.run(
            self.base,
            slots,
            True,
            input_ids=input_ids.to(dev),
            attention_mask=mask,
            position_ids=position_ids.to(dev),
            output_hidden_states=self._hs_select or False,
            **kwargs,
        )
        hidden = {i: out.hidden_states[i] for i in self._hs_select}
        return hidden, tok, out.last_hidden_state, caught

    def _shared(self, entry: PrefixEntry | None, packed: bool, used: list[int], input_ids, position_ids, slots):
        """Rows after a cached prefix, through `forge.runtime.forward.shared_prefix` where that is exact
        and pays (no per-row copy of the prefix's keys); None: run the cache path."""
        if entry is None or packed or not self._share_prefix:
            return None, {}
        heads = int(getattr(text_config(self.config), "num_attention_heads", 0) or 0)
        if not shared_prefix.worth_sharing(input_ids.shape[1], heads, entry.key_values):
            return None, {}
        hs = self._hs_select or False
        out, caught = self.hooks.run(
            lambda **kw: shared_prefix.forward(self.base, entry.key_values, used, **kw),
            slots,
            True,
            input_ids=input_ids,
            position_ids=position_ids,
            output_hidden_states=hs,
        )
        self._share_prefix = out is not None  # a family that cannot take it is not asked again
        return out, caught
