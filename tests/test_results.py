"""Batching never changes results: every mode equals a one-prompt-at-a-time forward pass."""

import json

import pytest
import torch

from conftest import SMALL, run_forge
from forge import load_activations
from forge.errors import ForgeError

LAYERS = [0, 2, 4]
N = 150
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

APART = "batching.merge_groups=false"  # prefix groups kept apart: the split-prefix and cache paths run
MODES = {
    "item": ["batching=item", "batching.batch_size=16", "runtime.executor=process"],  # workers in processes
    "item-sorted": ["batching=item", "batching.order=length"],
    "token-rows-cache": ["batching=token", "batching.merge_groups=false"],
    "token-rows-nocache": ["batching=token", "batching.prefix_cache=false"],
    "token-packed": ["batching=token", "batching.packing=packed", "batching.packed_row_tokens=128", APART],
    "token-tiny-cache": ["batching=token", "batching.cache_tokens=100", APART],  # capacity misses
    "memory": ["batching=memory", "devices.cpu_memory_gb=0.03", APART],
    "token-merged": ["batching=token"],  # the default: small prefix groups share tree rows
}


@pytest.fixture(scope="module")
def reference():
    """ids -> {pooling: {layer: vector}} from plain one-prompt forward passes."""
    from transformers import AutoModelForCausalLM

    from forge.api import InputSpec, ModelSpec
    from forge.functions.assets import embedded_model_source, materialize_model
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.runtime.forward.reference import pool, reference_hidden

    fn = ProbeGen(
        ProbeGenConfig(
            model=ModelSpec(name="embedded:tiny-llama"),
            input=InputSpec(path="embedded:statements", limit=N),
            layers=LAYERS,
        )
    )
    model = AutoModelForCausalLM.from_pretrained(materialize_model(embedded_model_source())).eval()
    ref = {}
    for item in fn.records():  # one forward pass per prompt, pooled both ways (what reference_pooled does per pooling)
        hidden = reference_hidden(model, item.tokens, LAYERS)
        ref[item.id] = {
            p: {layer: pool(h, item.prefix_len, p) for layer, h in hidden.items()} for p in ("last", "mean")
        }
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("mode", list(MODES))
def test_activations_equal_one_prompt_forward(tmp_path, reference, mode, pooling):
    report = run_forge(
        tmp_path,
        *SMALL,
        *MODES[mode],
        f"input.limit={N}",
        f"pooling={pooling}",
        f"layers=[{','.join(map(str, LAYERS))}]",
    )
    assert report["balanced"], report["imbalance"]
    assert report["items"]["completed"] == N
    if mode == "token-merged":  # small prefix groups shared tree batches: fewer of them
        assert report["batches"] > 1 and sum(d["tree_batches"] for d in report["devices"]) > 0
    else:
        assert report["batches"] > 3  # really batched
    ids, labels, layers = load_activations(tmp_path)
    assert sorted(ids) == sorted(reference) and len(labels) == N
    assert set(layers) == set(LAYERS)
    for layer in LAYERS:
        want = torch.stack([reference[i][pooling][layer] for i in ids])
        got = layers[layer]
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (mode, pooling, layer, (got - want).abs().max())
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["balanced"] and saved["batching"] == MODES[mode][0].split("=")[1]


def test_ids_and_labels_follow_input_order(tmp_path):
    run_forge(tmp_path, *SMALL, "input.limit=40", "layers=[1]")
    ids, labels, layers = load_activations(tmp_path)
    rows = [json.loads(line) for line in open(_dataset())][:40]
    assert ids == [r["id"] for r in rows]
    assert labels == [r["label"] for r in rows]
    assert layers[1].shape == (40, 256)


def _dataset():
    from forge.functions.assets import embedded_dataset_path

    return embedded_dataset_path()


def test_one_reader_streams_shards_and_reads_ragged_fields(tmp_path):
    """`shards` yields each committed shard; `load` is their rows in input order; ragged fields
    (a variable number of values per item) round-trip in Parquet and safetensors."""
    import numpy as np

    from forge.function import ResultColumns
    from forge.io.results import Field, ResultSchema, load, shards
    from forge.io.sinks import open_sink
    from forge.io.store import RunStore
    from forge.vocab.geometry import Batch, Item

    for fmt in ("parquet", "safetensors"):
        run = tmp_path / fmt
        store = RunStore(run, {"function": "test"})
        schema = ResultSchema(
            (Field("n", "int64"), Field("per_token", "float32", ragged=True)),
            format=fmt,
            folder="res",
            rows_per_shard=2,
        )
        sink = open_sink(store, schema)
        items = [Item(f"i{k}", 1, index=k) for k in range(5)]
        values = [np.arange(k + 1, dtype=np.float32) * (k + 1) for k in range(5)]
        for lo in (3, 0):  # committed out of order
            batch = Batch([[it] for it in items[lo : lo + 3]], 1)
            sink.write(
                batch,
                ResultColumns(
                    {
                        "n": np.array([k + 1 for k in range(lo, lo + 3)][: len(batch.items)]),
                        "per_token": values[lo : lo + 3],
                    }
                ),
                None,
            )
            sink.flush()
        sink.close()
        parts = list(shards(run))
        assert [p.ids for p in parts] == [["i3", "i4"], ["i0", "i1", "i2"]]
        res = load(run)
        assert res.ids == [f"i{k}" for k in range(5)] and res.columns["n"].tolist() == [1, 2, 3, 4, 5]
        for got, want in zip(res.columns["per_token"], values):
            assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize(
    "fmt,dtype",
    [
        ("parquet", "float32"),
        ("parquet", "float16"),
        ("safetensors", "float32"),
        ("safetensors", "bfloat16"),
        ("safetensors", "float16"),
    ],
)
def test_ragged_fields_of_vectors_round_trip(tmp_path, fmt, dtype):
    """A ragged field of shape (3,) holds an array [n, 3] per item (per-token states): it
    round-trips in each format and dtype, bfloat16 as real BF16 tensors (read back as float32),
    and the schema's byte count is what the shards hold."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from forge.function import ResultColumns
    from forge.io.results import Field, ResultSchema, load
    from forge.io.sinks import open_sink
    from forge.io.store import RunStore
    from forge.vocab.geometry import Batch, Item

    store = RunStore(tmp_path, {"function": "test"})
    schema = ResultSchema((Field("states", dtype, (3,), ragged=True), Field("n", "int32")), format=fmt, folder="res")
    sink = open_sink(store, schema)
    items = [Item(f"i{k}", k + 1, index=k) for k in range(4)]
    values = [torch.randn(k, 3) for k in range(4)]  # item 0 has no tokens
    sink.write(Batch([[it] for it in items], 4), ResultColumns({"states": values, "n": np.arange(4)}), None)
    sink.close()
    res = load(tmp_path)
    want = [v.to(getattr(torch, dtype)).float().numpy() for v in values]
    for got, w in zip(res.columns["states"], want):
        assert got.shape == w.shape and np.array_equal(got.astype(np.float32), w)
    assert schema.output_bytes(4, 6)["states"] == 6 * 3 * (4 if dtype == "float32" else 2)
    if fmt == "safetensors":
        with safe_open(str(next((tmp_path / "res").glob("*.safetensors"))), "pt") as f:
            assert f.get_tensor("states").dtype == getattr(torch, dtype)
            assert f.get_tensor("states").nbytes == schema.output_bytes(4, 6)["states"]


def test_a_shaped_ragged_value_of_the_wrong_width_is_refused(tmp_path):
    import numpy as np

    from forge.function import ResultColumns
    from forge.io.results import Field, ResultSchema
    from forge.io.sinks import open_sink
    from forge.io.store import RunStore
    from forge.vocab.geometry import Batch, Item

    sink = open_sink(
        RunStore(tmp_path, {"function": "test"}),
        ResultSchema((Field("states", "float32", (3,), ragged=True),), format="safetensors"),
    )
    with pytest.raises(
        ForgeError,
        match=r"result field 'states': the worker gave shape \(2, 4\) for one item, "
        r"expected \(n, 3\)",
    ):
        sink.write(Batch([[Item("a", 2, index=0)]], 2), ResultColumns({"states": [np.zeros((2, 4))]}), None)


@pytest.mark.parametrize(
    "function,field", [("score", "loglik"), ("embed", "embedding"), ("surprisal", "mean_nll"), ("probe_gen", "layer_4")]
)
def test_load_reads_any_functions_results(tmp_path, function, field):
    """One reader for every built-in (the README's promise): no folder needed, rows in input order."""
    from forge.io.results import load, shards

    report = run_forge(
        tmp_path, f"function={function}", "input.limit=8", *(["layers=[4]"] if function == "probe_gen" else [])
    )
    res = load(tmp_path)
    assert len(res) == report["items"]["completed"] > 0 and field in res.columns
    assert list(res.index) == sorted(res.index)
    assert sum(len(part) for part in shards(tmp_path)) == len(res)
