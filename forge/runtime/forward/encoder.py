"""Run a `forge.vocab.geometry.Batch` through a bidirectional encoder (BERT-style); return pooled vectors.

Model: an encoder's token sees every token of its own text, before and after it, and
nothing else. Two row layouts give exactly what a one-text forward pass gives:

a. rows (``packed=False``): one text per row, right padded, a 2D mask; the model numbers
   positions itself (padding sits after every real token, so no real position moves).
b. packed rows (``packed=True``): several texts end to end in a row; a 4D additive mask
   that is block diagonal (a token sees exactly the tokens of its own text; a padding slot
   sees only padding, so no softmax row is empty), position ids restarting at the family's
   first position for each text, token type ids 0. This needs a model whose forward takes
   explicit position ids and passes a prepared 4D mask through unchanged (transformers 5.x
   `create_bidirectional_mask` returns a 4D mask as is, for sdpa and eager), and a known
   position numbering: families not in `PACKED_POSITIONS` are refused before any work.

No prefix is ever split off or cached: an encoder's prefix states depend on the text after it.
Pooling (`mean` over every token of the text, special tokens included, as sentence-transformers
does; `cls`: the first token; `last`: the last token) and optional L2 normalisation happen here,
in float32.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from forge.errors import ForgeError
from forge.runtime.model.capabilities import MASK_IMPLS, choose_attn
from forge.runtime.model.class_facts import ClassFacts, class_facts
from forge.runtime.model.hf_compat import input_device, text_config
from forge.vocab.geometry import Batch

POOLINGS = ("mean", "cls", "last")
# Position of a text's first token, per family whose packed rows were measured exact (tiny
# random configs, sdpa and eager: max abs difference <= 2.4e-7; BERT and RoBERTa are asserted
# in tests/test_embed.py): "zero" counts from 0 (BERT); "pad+1" from pad_token_id + 1 (the
# RoBERTa family numbers positions after its padding index).
PACKED_POSITIONS = {
    "bert": "zero",
    "electra": "zero",
    "distilbert": "zero",
    "roberta": "pad+1",
    "xlm-roberta": "pad+1",
    "camembert": "pad+1",
    "mpnet": "pad+1",
}


@dataclass(frozen=True)
class EncoderCaps:
    """What an encoder can run exactly, read from its config and class (no weights)."""

    family: str  # config.model_type
    model_class: str  # the AutoModel class
    attn: str  # attention implementation to load
    attn_note: str  # why that one
    first_position: int | None  # packed rows: position id of each text's first token; None: unknown

    def refusal(self, packed: bool, cache: bool) -> str | None:
        """Why this layout cannot equal a one-text forward pass, as a one-line ForgeError message; None if it can."""
        if cache:
            return (
                f"batching.prefix_cache=true is not exact for {self.family}: it is a bidirectional encoder, "
                "so a prefix's states depend on the text after it; use batching.prefix_cache=false"
            )
        if packed and self.first_position is None:
            return (
                f"batching.packing=packed is not exact for {self.family}: Forge does not know how it numbers "
                f"positions in a packed row (known: {', '.join(PACKED_POSITIONS)}); use batching.packing=rows"
            )
        if packed and self.attn not in MASK_IMPLS:
            return (
                f"batching.packing=packed is not exact for {self.family}: packed rows need a 4D mask, which "
                f"{self.attn} attention does not take; use batching.packing=rows or model.attn_implementation=sdpa"
            )
        return None

    def check(self, packed: bool, cache: bool) -> None:
        reason = self.refusal(packed, cache)
        if reason:
            raise ForgeError(reason)

    def path(self, packed: bool) -> str:
        rows = (
            "packed rows on (block-diagonal bidirectional mask, positions restart per text)"
            if packed
            else "packed rows off"
        )
        return f"{self.family}: encoder, {self.attn} attention ({self.attn_note}); no prefix cache; {rows}"


def encoder_facts(config: Any) -> ClassFacts:
    """The facts about the class AutoModel loads for this config (no weights; kept between runs)."""
    return class_facts(config, "AutoModel")


def encoder_capabilities(config: Any, attn_implementation: str | None = "auto") -> EncoderCaps:
    facts = encoder_facts(config)
    family = str(getattr(config, "model_type", "model"))
    attn, note = choose_attn(family, facts, attn_implementation)
    kind = PACKED_POSITIONS.get(family)
    first = None
    if kind == "zero":
        first = 0
    elif kind == "pad+1" and getattr(config, "pad_token_id", None) is not None:
        first = int(config.pad_token_id) + 1
    return EncoderCaps(family, facts.name or "?", attn, note, first)


def pool_and_normalize(vectors: torch.Tensor, normalize: bool) -> torch.Tensor:
    """float32 vectors, L2-normalised per row when asked (as sentence-transformers' Normalize)."""
    vectors = vectors.float()
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if normalize else vectors


class EncoderRunner:
    """Runs batches of whole texts through a loaded encoder (`AutoModel`, eval mode, on its device)."""

    def __init__(
        self, model: Any, caps: EncoderCaps, pooling: str = "mean", normalize: bool = False, pad_token_id: int = 0
    ):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.model = model
        self.caps = caps
        self.pooling = pooling
        self.normalize = normalize
        self.pad_token_id = int(pad_token_id)
        self.device = input_device(model)  # a split model: its embeddings' device (outputs come back there)
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = int(getattr(text_config(model.config), "hidden_size", 0))
        self._takes = set(inspect.signature(model.forward).parameters)  # named keyword arguments only

    def run(self, batch: Batch) -> torch.Tensor:
        """float32 CPU [n_items, hidden], in `batch.items` order."""
        with torch.inference_mode():
            return self._run(batch)

    def _run(self, batch: Batch) -> torch.Tensor:
        n = len(batch.items)
        if n == 0:
            return torch.empty(0, self.hidden_size)
        hidden, (tok_item, tok_row, tok_col), rows_t, starts_t, lens = self.forward(batch)
        hidden = hidden[None]
        if self.pooling == "mean":
            sums = torch.zeros(n, hidden.shape[-1], dtype=torch.float32, device=self.device)
            sums.index_add_(
                0, tok_item.to(self.device), hidden[tok_row.to(self.device), tok_col.to(self.device)].float()
            )
            vectors = sums / lens.to(self.device, torch.float32)[:, None]
        else:
            col = starts_t if self.pooling == "cls" else starts_t + lens - 1
            vectors = hidden[rows_t.to(self.device), col.to(self.device)]
        return pool_and_normalize(vectors, self.normalize).cpu()

    def forward(self, batch: Batch, layers: list[int] | None = None):
        """The batch's forward pass: ({layer: [rows, padded_len, hidden]} (None: last_hidden_state),
        (tok_item, tok_row, tok_col), each item's row, first slot and length)."""
        items = batch.items
        n = len(items)
        if batch.prefix_len and batch.split_prefix:
            raise ValueError("an encoder batch cannot split off a prefix")
        seqs = [torch.as_tensor(it.tokens, dtype=torch.long).reshape(-1) for it in items]
        for it, s in zip(items, seqs):
            if s.numel() == 0 or s.numel() != it.num_tokens:
                raise ValueError(f"item {it.id!r}: num_tokens={it.num_tokens} but it has {s.numel()} token ids")
        if not batch.packed and any(len(row) > 1 for row in batch.rows):
            raise ValueError("a row holds several items but batch.packed is False")
        reason = self.caps.refusal(batch.packed, cache=False)
        if reason:
            raise ValueError(reason)

        # where each item sits: its row, its first slot, its length
        lens = torch.tensor([s.numel() for s in seqs])
        rows, starts, used = [], [], [0] * len(batch.rows)
        for r, row in enumerate(batch.rows):
            for _ in row:
                rows.append(r)
                starts.append(used[r])
                used[r] += int(lens[len(rows) - 1])
        S = int(batch.padded_len)
        if max(used) > S:
            raise ValueError(f"a row holds {max(used)} tokens but padded_len is {S}")
        B = len(batch.rows)
        rows_t, starts_t = torch.tensor(rows), torch.tensor(starts)
        tok_item = torch.repeat_interleave(torch.arange(n), lens)
        tok_within = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[tok_item]
        tok_row, tok_col = rows_t[tok_item], starts_t[tok_item] + tok_within

        input_ids = torch.full((B, S), self.pad_token_id, dtype=torch.long)
        input_ids[tok_row, tok_col] = torch.cat(seqs)
        kwargs: dict[str, Any] = {}
        if "token_type_ids" in self._takes:  # 0 everywhere, as for a single text
            kwargs["token_type_ids"] = torch.zeros(B, S, dtype=torch.long, device=self.device)
        if "use_cache" in self._takes:
            kwargs["use_cache"] = False
        if batch.packed:
            seg = torch.full((B, S), -1, dtype=torch.long)  # -1: padding, which sees only padding
            seg[tok_row, tok_col] = tok_item
            first = self.caps.first_position
            assert first is not None  # packed rows give explicit positions: the family's first one is known
            position_ids = torch.full((B, S), first, dtype=torch.long)
            position_ids[tok_row, tok_col] = first + tok_within
            allowed = seg[:, None, :, None] == seg[:, None, None, :]  # (B, 1, S, S): same text
            mask = torch.zeros(B, 1, S, S, dtype=self.dtype)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            kwargs.update(attention_mask=mask.to(self.device), position_ids=position_ids.to(self.device))
        else:
            mask = (torch.arange(S)[None, :] < torch.tensor(used)[:, None]).long()
            kwargs["attention_mask"] = mask.to(self.device)
        if layers:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=input_ids.to(self.device), **kwargs)
        hidden: dict[int | None, torch.Tensor] = {None: out.last_hidden_state}
        for layer in layers or ():
            hidden[layer] = out.hidden_states[layer]
        return hidden, (tok_item, tok_row, tok_col), rows_t, starts_t, lens


class EncoderViews:
    """Item views (`forge.runtime.forward.views.ItemView`) of batches run through an encoder: each text's
    hidden states at the requested layers, its own tokens in order (an encoder has no prefix)."""

    def __init__(self, model: Any, caps: EncoderCaps, layers: list[int], pad_token_id: int = 0):
        from forge.runtime.model.hf_compat import num_layers

        self.runner: EncoderRunner | None = EncoderRunner(model, caps, "mean", False, pad_token_id)
        self.layers = list(layers)
        n = num_layers(model.config)
        # the final index is last_hidden_state itself: other layers need output_hidden_states
        self.source = {layer: None if layer % (n + 1) == n else layer % (n + 1) for layer in self.layers}

    def run(self, batch: Batch):
        from forge.runtime.forward.views import ItemView, ViewBatch, token_list
        from forge.runtime.tokens.prompts import ItemMeta

        items = batch.items
        if not items:
            return ViewBatch([], 0, False)
        with torch.inference_mode():
            fetch = sorted({i for i in self.source.values() if i is not None})
            assert self.runner is not None, "run after close"
            hidden, _, rows_t, starts_t, lens = self.runner.forward(batch, fetch)
        views = []
        empty = torch.empty(0, dtype=torch.long)
        for k, item in enumerate(items):
            r, s, n = int(rows_t[k]), int(starts_t[k]), int(lens[k])
            meta = item.meta if isinstance(item.meta, ItemMeta) else ItemMeta(label=item.meta)
            views.append(
                ItemView(
                    item.id,
                    item.index,
                    token_list(item.tokens),
                    0,
                    {layer: hidden[i][r, s : s + n] for layer, i in self.source.items()},
                    {},
                    empty,
                    None,
                    None,
                    meta.label,
                    meta.data,
                )
            )
        return ViewBatch(views, 0, False)

    def close(self) -> None:
        self.runner = None


def reference_embedding(model: Any, tokens, pooling: str, normalize: bool) -> torch.Tensor:
    """Ground truth for tests: one text, one row, no padding, no mask; float32 CPU [hidden]."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1).to(input_device(model))
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False)
    h = out.last_hidden_state[0] if hasattr(out, "last_hidden_state") else out.hidden_states[-1][0]
    v = {"mean": lambda: h.float().mean(0), "cls": lambda: h[0], "last": lambda: h[-1]}[pooling]()
    return pool_and_normalize(v[None], normalize)[0].cpu()


def check_encoder(config: Any, forward: Any, name: str, model_name: str, intervene: bool = False) -> None:
    """Refuse, at construction, an encoder function that cannot run: targets or logits (an encoder
    has no LM head), hook points (causal LMs only, so far), a model_type without an AutoModel class."""
    if forward.lm_head or forward.head:
        raise ForgeError(f"{name}: an encoder has no LM head; Forward(targets/logits/head) needs a CausalLMFunction")
    if forward.capture or intervene:
        raise ForgeError(f"{name}: capture and intervene run on causal LMs (a CausalLMFunction), not encoders")
    if encoder_facts(config).name is None:
        raise ForgeError(
            f"model.name={model_name}: transformers has no encoder (AutoModel) class for "
            f"model_type {getattr(config, 'model_type', '?')!r}"
        )
