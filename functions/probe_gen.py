"""probe_gen: hidden-state activations of prompts (shared few-shot prefix + statement) at
chosen layers of a Hugging Face causal LM, saved for linear probes and dictionary training.

Written on `forge.api`: the base reads rows (`text`, optional `prefix`, `label`, `id`),
applies the token rule (a prefix tokenized alone with the special tokens, the text after it
without them), runs every batching mode exactly and commits the results. This file says what is
kept, per item and layer:

* `pooling=last`: the state of its last token (an item that is all prefix: the prefix's last);
* `pooling=mean`: the mean over its tokens after the prefix;
* `pooling=none`: every token's state after the prefix, [tokens, hidden] (a ragged field), with
  the token ids, the prefix's length and id (`prefix_id`: its key as an integer; -1: none). With
  `prefix_states=once` each distinct prefix's own states are stored once, as an item of their
  own in the folder ``prefix_states/``, and `forge.data.token_states` can put them back.

Pooled states are float32 unless `storage_dtype` says otherwise; per-token states are the
model's dtype by default. Shards are safetensors under ``activations/``, labels journaled
(`forge.load_activations` for pooled runs, `forge.data.token_states` for per-token runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge.api import (
    MISSING,
    CausalLMFunction,
    Field,
    ForgeError,
    Forward,
    ItemView,
    ModelFunctionConfig,
    Prompt,
    Row,
    Tokens,
    one_of,
    positive,
)

POOLINGS = ("last", "mean", "none")
STORAGE_DTYPES = ("float32", "bfloat16", "float16")
PREFIX_FOLDER = "prefix_states"  # pooling=none, prefix_states=once: each distinct prefix's states
HIDDEN_WIDE = ("resid_pre", "resid_post", "attn_out", "mlp_in", "mlp_out")  # hook points of hidden_size values
PREFIX_ROW = "prefix"  # the id suffix of the item holding a prefix's states: "<row id>/prefix"


@dataclass(frozen=True)
class PrefixRow:
    """`Prompt.data` of the item that holds a prefix's own states (prefix_states=once)."""

    key: str  # the prefix's key (the token rule's)


@dataclass
class ProbeGenConfig(ModelFunctionConfig):
    """The root keys probe_gen reads, checked at the edge."""

    layers: list[int] = MISSING  # hidden_states[L] of the forward pass; 0 = embeddings
    # hook points kept too, pooled alike (resid_pre.L, resid_post.L, attn_out.L, mlp_in.L, mlp_out.L, or a
    # module path with one vector per token): a field per point, named as the point
    capture: list[str] = field(default_factory=list)
    # last: the last token; mean: mean over the tokens after the prefix; none: every token's state
    # after the prefix (forge.data.token_states reads them)
    pooling: str = one_of("last", *POOLINGS)
    storage_dtype: str | None = None  # float32 | bfloat16 | float16; null: float32 pooled, the model's per token
    prefix_states: str = one_of("once", "once", "none")  # pooling=none: store each prefix's states once, or not
    shard_mb: int = positive(CausalLMFunction.shard_bytes >> 20)  # a shard is also cut at this many MiB (pooling=none)


class ProbeGen(CausalLMFunction):
    name = "probe_gen"
    config_schema = ProbeGenConfig
    format = "safetensors"
    folder = "activations"
    keep_labels = True

    def __init__(self, config: ProbeGenConfig):
        pooling, storage_dtype = config.pooling, config.storage_dtype
        if pooling not in POOLINGS:
            raise ForgeError(f"pooling={pooling!r}; choose one of: {', '.join(POOLINGS)}")
        if storage_dtype is not None and storage_dtype not in STORAGE_DTYPES:
            raise ForgeError(
                f"storage_dtype={storage_dtype!r}; choose one of: {', '.join(STORAGE_DTYPES)} "
                "(or null: float32 pooled, the model's dtype per token)"
            )
        self.layers, self.pooling, self.prefix_states = list(config.layers), pooling, config.prefix_states
        self.capture = list(config.capture)
        self.shard_bytes = int(config.shard_mb) << 20
        if not self.layers and not self.capture:
            raise ForgeError("layers=[] and capture=[]: choose at least one layer (0 = embeddings) or hook point")
        if any(c.startswith("attn_pattern.") for c in self.capture):
            raise ForgeError("probe_gen keeps one vector per token; read attention patterns in a function of your own")
        # set before the base checks it against the model
        self.forward = Forward(layers=tuple(self.layers), capture=tuple(self.capture))
        super().__init__(config)
        if (
            pooling == "none"
            and self.prefix_states == "once"
            and any(iv.span in ("text", "last", "prefix") for iv in self.interventions.items)
        ):
            raise ForgeError(
                "prefix_states=once stores each prefix run as an item of its own, where intervene spans text, last "
                "and prefix name other tokens than in the items; set prefix_states=none (or span: all or positions)"
            )
        if pooling == "none" and self.prefix_states == "once" and self.interventions.row_dependent:
            raise ForgeError(
                "prefix_states=once stores each prefix run as an item of its own, which has no row's own intervene "
                "parameters (row.<column>, op: patch, positions from the end); set prefix_states=none"
            )
        self.dtype = storage_dtype or (self.model.torch_dtype if pooling == "none" else "float32")
        hidden = (self.hidden_size,)
        self.fields = tuple(
            Field(f"layer_{layer}", self.dtype, hidden, ragged=pooling == "none") for layer in self.layers
        ) + tuple(Field(name, self.dtype, None, ragged=pooling == "none") for name in self.capture)
        if pooling == "none":
            self.fields += (
                Field("token_ids", "int32", (), ragged=True),
                Field("prefix_id", "int64"),
                Field("prefix_len", "int32"),
            )
        self._stored: set[str] = set()  # prefixes whose states have an item of their own (prefix_states=once)

    def options(self) -> dict[str, Any]:
        per_token = (
            {"storage_dtype": self.dtype, "prefix_states": self.prefix_states}
            if self.pooling == "none"
            else {"storage_dtype": self.dtype}
            if self.dtype != "float32"
            else {}
        )
        captured = {"capture": self.capture} if self.capture else {}
        return {"layers": self.layers, "pooling": self.pooling, **captured, **per_token}

    def output_bytes(self, items: int, own_tokens: int) -> dict[str, int | None] | None:
        """The base's sizes, and a capture at a residual, attention or MLP point (whose width
        is the model's hidden size; a module path's is not known before the run) sized as a layer."""
        out = super().output_bytes(items, own_tokens)
        if out is None:
            return None
        per = Field("_", self.dtype, (self.hidden_size,)).value_bytes() or 0
        for name in self.capture:
            if out.get(name) is None and name.partition(".")[0] in HIDDEN_WIDE:
                out[name] = per * (own_tokens if self.pooling == "none" else items)
        return out

    def path(self) -> str:
        """How it runs; with prefix_states=once, why there are more items than input rows."""
        base = super().path()
        if self.pooling != "none" or self.prefix_states != "once" or not self._stored:
            return base
        n = len(self._stored)
        return (
            f"{base}; items = input rows + {n:,} prefix-state item{'s' if n != 1 else ''} (prefix_states=once "
            f"stores each distinct prefix's states once, in {PREFIX_FOLDER}/)"
        )

    def memory_pooling(self) -> str:
        return "last" if self.pooling == "last" else "mean"

    # -- pooling=none, prefix_states=once: a prefix's states are an item of their own, once ----
    @property
    def seekable(self) -> bool:  # type: ignore[override]  # which prefixes were stored depends on the rows before
        return self.pooling != "none" or self.prefix_states != "once"

    def records(self):
        self._stored = set()  # each pass reads the input from its start (the same items, the same keys)
        return super().records()

    def prompts(self, row: Row) -> list[Prompt] | str:
        made = super().prompts(row)
        prefix = made[0].prefix if isinstance(made, list) else None
        if self.pooling != "none" or self.prefix_states != "once" or prefix is None or prefix in self._stored:
            return made
        self._stored.add(prefix)
        return [Prompt(prefix, None, None, PrefixRow(self.token_rule.prefix(prefix)[0]), suffix=PREFIX_ROW), *made]

    def tokenize(self, prompts: list[Prompt]) -> list[Tokens | str]:
        """The token rule, and a prefix's own item: the prefix's ids, exactly as it runs before a text."""
        mine = [isinstance(p.data, PrefixRow) for p in prompts]
        rest = iter(super().tokenize([p for p, m in zip(prompts, mine) if not m]))
        return [Tokens([], self.token_rule.prefix(p.text)[1]) if m else next(rest) for p, m in zip(prompts, mine)]

    def open_sink(self, store):
        if self.pooling != "none" or self.prefix_states != "once":
            return super().open_sink(store)
        from dataclasses import replace

        from forge.api import ResultSink, RoutedSink

        main = self.result_schema()
        sinks = {
            "items": super().open_sink(store),
            PREFIX_FOLDER: ResultSink(
                store, replace(main, folder=PREFIX_FOLDER, meta_key=None, meta={**main.meta, "part_of": main.folder})
            ),
        }
        return RoutedSink(sinks, lambda item: PREFIX_FOLDER if isinstance(item.meta.data, PrefixRow) else "items")

    def reduce(self, view: ItemView) -> dict[str, Any]:
        own = view.tokens[view.prefix_len :]
        if self.pooling == "last":
            out = {f"layer_{layer}": view.last(layer) for layer in self.layers}
            if self.capture and not own:
                raise ValueError(f"item {view.id!r} has no tokens after its prefix: no last token to capture at")
            return {k: v.to(self.torch_dtype) for k, v in {**out, **self._captured(view, -1)}.items()}
        if self.pooling == "none":
            import torch

            key = view.data.key if isinstance(view.data, PrefixRow) else view.prefix_key
            return {
                **{f"layer_{layer}": view.hidden[layer].to(self.torch_dtype) for layer in self.layers},
                **{name: v.to(self.torch_dtype) for name, v in self._captured(view, None).items()},
                "token_ids": torch.as_tensor(own, dtype=torch.int32),
                "prefix_id": prefix_id(key),
                "prefix_len": view.prefix_len,
            }
        if not own:
            raise ValueError(f"item {view.id!r} has no tokens after its prefix; mean pooling needs at least one")
        states = {f"layer_{layer}": view.hidden[layer] for layer in self.layers} | self._captured(view, None)
        return {name: v.float().mean(dim=0).to(self.torch_dtype) for name, v in states.items()}

    def _captured(self, view: ItemView, at: int | None) -> dict[str, Any]:
        """Each capture's per-token vectors (flattened past the token axis), or the one at `at`."""
        values = {name: view.captured[name].flatten(1) for name in self.capture}
        return values if at is None else {name: v[at] for name, v in values.items()}

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def prefix_id(key: str | None) -> int:
    """A prefix key (12 hex digits) as the integer stored in `prefix_id` (-1: no prefix)."""
    return -1 if key is None else int(key.partition("|")[0], 16)  # (after "|": the interventions' key)
