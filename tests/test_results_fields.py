"""Every stored field readable at scale: a captured per-token field streamed by
`forge.data.token_states` equal to `load`'s, sized by the plan before the run, read by `load`
without `folder=`, the prefix states' items explained; and results as a `datasets.Dataset`."""

import collections

import numpy as np
import pytest

from conftest import plan_forge, run_forge
from forge.errors import ForgeError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
N = 30
CAPTURE = ["function=probe_gen", "layers=[]", "capture=[mlp_out.2]", "pooling=none", "storage_dtype=float32"]
SMALL = [
    "devices=auto",
    "devices.limits.max_batch_tokens=1024",
    "devices.limits.max_seq_len=512",
    "budget.tokens_per_step=1024",
    f"input.limit={N}",
    "shard_size=8",
]


@pytest.fixture(scope="module")
def capture_run(tmp_path_factory):
    """A capture-only pooling=none run (mlp_out.2, each prefix's states once), with its plan."""
    out = tmp_path_factory.mktemp("capture")
    planned = plan_forge(*CAPTURE, *SMALL)
    report = run_forge(out, *CAPTURE, *SMALL)
    assert report["status"] == "finished" and report["balanced"]
    return out, planned, report


@pytest.mark.slow  # the module's capture run: about 10 s
def test_the_plan_counts_captured_fields_within_10_percent_of_what_the_run_writes(capture_run):
    out, planned, _ = capture_run
    written = sum(p.stat().st_size for p in out.glob("*/*.safetensors"))
    sized = planned["output_bytes"]
    assert sized["fields"]["mlp_out.2"] and not sized["unknown"]
    assert abs(sized["total"] - written) <= 0.1 * written, (sized["total"], written)


@pytest.mark.slow  # the module's capture run: about 10 s
def test_the_disk_check_counts_captured_fields(capture_run, monkeypatch):
    from conftest import spec_for
    from forge.driver.output_size import check_space

    out, _, _ = capture_run
    spec = spec_for(*CAPTURE, *SMALL)
    sized = check_space(spec.function, out, N)
    written = sum(p.stat().st_size for p in out.glob("*/*.safetensors"))
    assert sized is not None and abs(sized["total"] - written) <= 0.1 * written, (sized["total"], written)


@pytest.mark.slow  # the module's capture run: about 10 s
def test_token_states_streams_a_captured_field_equal_to_loads(capture_run):
    from forge.data import token_states
    from forge.io.results import load

    out, _, _ = capture_run
    res = load(out)  # no folder=: prefix_states/ is part of activations/
    want = collections.OrderedDict()
    for k, index in enumerate(res.index.tolist()):
        for j, row in enumerate(res.columns["mlp_out.2"][k]):
            want[(index, int(res.columns["prefix_len"][k]) + j)] = row
    ds = token_states(out, field="mlp_out.2", batch_size=32, shuffle_buffer=64, chunk_tokens=48, with_ids=True)
    got = {}
    for batch in ds:
        for s, i, p in zip(batch["states"].numpy(), batch["item_index"].tolist(), batch["position"].tolist()):
            assert (i, p) not in got
            got[(i, p)] = s
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[key], want[key]) for key in want)
    assert ds.max_pool_tokens <= 64 + 32 + 48  # the shuffle buffer, a batch and a chunk: flat memory
    plain = next(iter(token_states(out, "mlp_out.2", batch_size=16, shuffle_buffer=32)))
    assert tuple(plain.shape) == (16, 256)


@pytest.mark.slow  # the module's capture run: about 10 s
def test_token_states_names_the_fields_a_run_stores(capture_run):
    from forge.data import token_states

    out, _, _ = capture_run
    with pytest.raises(
        ForgeError, match=r"layer=2: the run stored layers \[\]; choose one of them \(or field= one of mlp_out.2\)"
    ):
        token_states(out, layer=2)
    with pytest.raises(ForgeError, match=r"field='mlp_out.3': .* stores mlp_out.2 per token; choose one of them"):
        token_states(out, field="mlp_out.3")


@pytest.mark.slow  # the module's capture run: about 10 s
def test_load_reads_the_rows_of_a_pooling_none_run_without_folder(capture_run):
    from forge.io.results import load

    out, _, _ = capture_run
    assert sorted(p.name for p in out.iterdir() if (p / "meta.json").exists()) == ["activations", "prefix_states"]
    res = load(out)
    assert len(res) == N and set(res.columns) == {"mlp_out.2", "token_ids", "prefix_id", "prefix_len"}
    assert len(load(out, "prefix_states")) == load(out, "prefix_states").index.size > 0


@pytest.mark.slow  # the module's capture run: about 10 s
def test_the_summary_says_why_there_are_more_items_than_input_rows(capture_run):
    from forge.io.results import load

    out, _, report = capture_run
    prefixes = len(load(out, "prefix_states"))
    assert report["items"]["received"] == N + prefixes
    assert f"items = input rows + {prefixes} prefix-state items (prefix_states=once" in report["path"]


@pytest.mark.slow
def test_results_as_a_dataset_share_the_runs_arrow_data(tmp_path):
    datasets = pytest.importorskip("datasets")
    from forge.io.results import load

    run_forge(tmp_path, "function=probe_gen", "layers=[1,4]", *SMALL)
    res = load(tmp_path)
    ds = res.to_dataset()
    assert isinstance(ds, datasets.Dataset) and ds.num_rows == N
    assert ds["id"] == list(res.ids) and ds.column_names == ["id", "index", "layer_1", "layer_4"]
    column = ds.data.table.column("layer_1").chunk(0)
    assert column.values.buffers()[1].address == res.columns["layer_1"].ctypes.data  # the same memory: no copy
    assert np.array_equal(np.asarray(ds.with_format("numpy")["layer_4"]), res.columns["layer_4"])
    ds.save_to_disk(str(tmp_path / "saved"))
    assert datasets.load_from_disk(str(tmp_path / "saved"))["index"] == res.index.tolist()


def test_to_dataset_without_the_extra_is_one_line(monkeypatch):
    import sys

    from forge.io.results import Results

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ForgeError, match=r"pip install 'forge\[datasets\]'"):
        Results(["a"], np.zeros(1, np.int64), {"x": np.zeros(1)}, None, {}).to_dataset()
