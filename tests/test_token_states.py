"""Every token's activations (`probe_gen pooling=none`): exact in every mode, each prefix stored
once, exactly once after kill -9 and resume, sized before the run, and streamed by the loader
(forge.data.token_states) exactly once per epoch, in a seeded order, in bounded memory."""

import collections
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import forge_process, plan_forge
from forge.errors import ForgeError
from forge.testing import run_function

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
TESTS = Path(__file__).resolve().parent
LAYERS = [0, 2, 4]
MODES = {
    "item": ["batching=item", "batching.batch_size=5"],
    "token-cache": ["batching=token", "batching.merge_groups=false"],
    "token-nocache": ["batching=token", "batching.prefix_cache=false"],
    "token-packed": [
        "batching=token",
        "batching.packing=packed",
        "batching.packed_row_tokens=96",
        "batching.merge_groups=false",
    ],
}
# small steps, so that 23 rows make several batches of several items (prefixes of 45, 97 and 119 tokens)
SMALL_LIMITS = [
    "devices=auto",
    "devices.limits.max_batch_tokens=384",
    "devices.limits.max_seq_len=192",
    "budget.tokens_per_step=384",
]
NONE = ["pooling=none", f"layers=[{','.join(map(str, LAYERS))}]", "storage_dtype=float32"]

NOUNS = ["kettle", "glacier", "violin", "comet", "lantern", "cactus", "harbor", "pigeon", "quartz", "tunnel", "meadow"]
ADJS = ["warm", "heavy", "hollow", "bright", "ancient", "brittle"]


def held_out_rows() -> list[dict]:
    """Few-shot rows written for this test (not the embedded statements): three prefixes of
    different lengths, texts of 1 to 3 claims, and two rows without a prefix."""
    shots = [
        f"Claim: The {n} is {a}. Answer: {'true' if k % 2 else 'false'}\n"
        for k, (n, a) in enumerate(zip(NOUNS[::-1], ADJS * 2))
    ]
    prefixes = [
        "Judge each claim.\n" + "".join(shots[:2]),
        "Judge each claim.\n" + "".join(shots[:5]),
        "Say whether it holds.\n" + "".join(shots[3:9]),
    ]
    rows = []
    for j in range(21):
        claims = " ".join(
            f"The {NOUNS[(j + k) % len(NOUNS)]} is {ADJS[(j * 3 + k) % len(ADJS)]}." for k in range(1 + j % 3)
        )
        rows.append({"id": f"h{j}", "text": f"Claim: {claims} Answer:", "prefix": prefixes[j % 3], "label": j % 2})
    rows += [
        {"id": "bare0", "text": "Claim: The comet is warm. Answer:", "label": 0},
        {"id": "bare1", "text": "Claim: A harbor is hollow and bright. Answer:", "label": 1},
    ]
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-states")
    path = root / "rows.jsonl"
    rows = held_out_rows()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


@pytest.fixture(scope="module")
def reference(data):
    """An independent one-row-at-a-time `transformers` forward pass: per row id, its text's
    token ids and hidden states [text tokens, hidden] at each layer; per prefix, its states."""
    from forge.functions.assets import embedded_model_source, materialize_model

    src = materialize_model(embedded_model_source())  # the embedded model's weights, made from its config once
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rows, prefixes = {}, {}
    with torch.no_grad():
        for row in data[1]:
            pre = tok(row["prefix"])["input_ids"] if row.get("prefix") else []
            text = tok(row["text"], add_special_tokens=not pre)["input_ids"]
            hidden = model(torch.tensor([pre + text]), output_hidden_states=True).hidden_states
            rows[row["id"]] = (text, {L: hidden[L][0, len(pre) :] for L in LAYERS})
            if pre:
                prefixes[tuple(pre)] = {L: hidden[L][0, : len(pre)] for L in LAYERS}
    return rows, prefixes


def _check_states(run_dir: Path, reference, tol: float = 1e-4) -> float:
    from forge.io.results import load

    rows, prefixes = reference
    res = load(run_dir, "activations")
    assert sorted(res.ids) == sorted(rows), "every row once"
    worst = 0.0
    for k, item in enumerate(res.ids):
        text, states = rows[item]
        assert res.columns["token_ids"][k].tolist() == text, item
        for L in LAYERS:
            got = res.columns[f"layer_{L}"][k]
            assert got.shape == tuple(states[L].shape), (item, L)
            worst = max(worst, float(np.abs(got - states[L].numpy()).max()))
    pre = load(run_dir, "prefix_states")
    assert len(pre) == len(prefixes) == len(set(pre.columns["prefix_id"].tolist())), "each prefix stored once"
    for k in range(len(pre)):
        want = prefixes[tuple(pre.columns["token_ids"][k].tolist())]
        for L in LAYERS:
            worst = max(worst, float(np.abs(pre.columns[f"layer_{L}"][k] - want[L].numpy()).max()))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("mode", list(MODES))
def test_every_token_state_equals_a_one_row_forward_pass(tmp_path, data, reference, mode):
    report = run_function("probe_gen", data[0], tmp_path, [*SMALL_LIMITS, *MODES[mode], *NONE])
    assert report["balanced"] and report["items"]["failed"] == 0
    assert report["batches"] > 3  # several batches of several items
    _check_states(tmp_path, reference)
    info = json.loads((tmp_path / "activations" / "meta.json").read_text())
    assert info["pooling"] == "none" and info["prefix_states"] == "once"


def test_prefix_states_none_stores_only_each_items_own_tokens(tmp_path, data, reference):
    from forge.io.results import load, result_folders

    run_function("probe_gen", data[0], tmp_path, [*SMALL_LIMITS, *NONE, "prefix_states=none", "shard_mb=1"])
    assert result_folders(tmp_path) == ["activations"]
    shards = sorted((tmp_path / "activations").glob("*.safetensors"))
    assert len(shards) >= 2  # ~1.4 MB of states: cut at 1 MiB, not at shard_size=4096 rows
    assert all(s.stat().st_size <= (1 << 20) + 3 * 384 * 1024 for s in shards[:-1])  # 1 MiB and at most one batch
    res = load(tmp_path)
    assert len(res) == len(reference[0])
    assert sum(len(t) for t in res.columns["token_ids"]) == sum(len(t) for t, _ in reference[0].values())


def test_bfloat16_storage_is_the_reference_rounded(tmp_path, data, reference):
    from safetensors import safe_open

    from forge.io.results import load

    run_function("probe_gen", data[0], tmp_path, [*SMALL_LIMITS, "batching=token", *NONE[:2], "storage_dtype=bfloat16"])
    with safe_open(str(next((tmp_path / "activations").glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("layer_2").dtype == torch.bfloat16
    res = load(tmp_path, "activations")
    for k, item in enumerate(res.ids):
        want = reference[0][item][1][2].numpy()
        # float32 states that agree within 1e-5 round to the same bfloat16 or to a neighbour
        assert np.all(np.abs(res.columns["layer_2"][k] - want) <= np.abs(want) * 2**-7 + 1e-5), item


def test_plan_states_the_bytes_the_run_writes(tmp_path, data):
    from safetensors import safe_open

    overrides = [f"input.path={data[0]}", "function=probe_gen", *SMALL_LIMITS, *NONE]
    sized = plan_forge(*overrides)["output_bytes"]
    run_function("probe_gen", data[0], tmp_path, [*SMALL_LIMITS, *NONE])
    held = collections.Counter()
    for shard in tmp_path.glob("*/*.safetensors"):
        with safe_open(str(shard), "np") as f:
            for key in f.keys():
                if not key.endswith(".offsets"):
                    held[key] += f.get_tensor(key).nbytes
    assert sized["fields"] == dict(held) and sized["total"] == sum(held.values())
    hidden = 256
    assert sized["fields"]["layer_2"] == sized["stored_tokens"] * hidden * 4
    assert sized["per_stored_token"] == pytest.approx(sized["total"] / sized["stored_tokens"])


def test_a_disk_without_room_is_refused_before_any_work(tmp_path, data, monkeypatch):
    import shutil

    from forge.driver import output_size

    free = shutil.disk_usage(tmp_path)._replace(free=100_000)
    monkeypatch.setattr(output_size.shutil, "disk_usage", lambda path: free)
    run = tmp_path / "run"
    with pytest.raises(
        ForgeError,
        match=r"output_dir=.*run: the run will write about [\d.]+ MB .* per stored "
        r"token, estimated from 23 of 23 rows\) but its disk has 100.0 KB free; .*"
        r"set check_disk=false",
    ):
        run_function("probe_gen", data[0], run, [*SMALL_LIMITS, *NONE])
    assert not (run / "run.json").exists() and not (run / "activations").exists()
    report = run_function("probe_gen", data[0], run, [*SMALL_LIMITS, *NONE, "check_disk=false"])
    assert report["items"]["completed"] == 26  # 23 rows and 3 prefixes


@pytest.mark.slow
def test_kill9_then_resume_stores_every_token_exactly_once(tmp_path, data, reference, faults):
    out = tmp_path / "run"
    args = [
        f"input.path={data[0]}",
        *SMALL_LIMITS,
        "batching=token",
        *NONE,
        "shard_size=4",
        "runtime.executor=process",
        "plugins=[faults]",
        "runtime.max_in_flight=1",
        f"output_dir={out}",
    ]
    faults(kill_run_at_write=3)  # SIGKILL to the whole process group while the 3rd shard is written
    proc = forge_process(*args, env=dict(os.environ))
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == -signal.SIGKILL, log[-2000:]
    lines = (out / "commits.jsonl").read_text().splitlines()
    assert 2 <= len(lines) and not (out / "report.json").exists()
    faults()
    proc = forge_process(*args, "resume=true", env=dict(os.environ))
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, log[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["balanced"] and report["items"]["resumed"] > 0 and report["items"]["completed"] == 26
    _check_states(out, reference)


# -- the loader -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def states_run(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("states-run")
    run_function("probe_gen", data[0], run, [*SMALL_LIMITS, *NONE, "shard_size=5"])
    return run


def _stored(run: Path, layer: int, prefix: str) -> dict[tuple[int, int], np.ndarray]:
    """(item index, position) -> state, straight from the shards."""
    from forge.io.results import load

    out = {}
    res, prefixes = load(run, "activations"), load(run, "prefix_states")
    pre = {int(p): s for p, s in zip(prefixes.columns["prefix_id"], prefixes.columns[f"layer_{layer}"])}
    for k, index in enumerate(res.index.tolist()):
        own, pid, plen = (
            res.columns[f"layer_{layer}"][k],
            int(res.columns["prefix_id"][k]),
            int(res.columns["prefix_len"][k]),
        )
        for p, s in enumerate(own):
            out[(index, plen + p)] = s
        if prefix == "each" and pid >= 0:
            for p, s in enumerate(pre[pid]):
                out[(index, p)] = s
    if prefix == "once":  # each prefix's states once, under its own item's index
        for k, index in enumerate(prefixes.index.tolist()):
            for p, s in enumerate(prefixes.columns[f"layer_{layer}"][k]):
                out[(index, p)] = s
    return out


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["drop", "once", "each"])
def test_the_loader_yields_every_token_once_per_epoch_across_two_workers(states_run, prefix):
    from torch.utils.data import DataLoader

    from forge.data import token_states

    want = _stored(states_run, 2, prefix)
    ds = token_states(states_run, layer=2, batch_size=64, shuffle_buffer=256, seed=3, prefix=prefix, with_ids=True)
    order, seen = [], collections.Counter()
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        assert batch["states"].shape[1] == 256 and len(batch["states"]) <= 64
        for k, key in enumerate(zip(batch["item_index"].tolist(), batch["position"].tolist())):
            seen[key] += 1
            assert np.array_equal(batch["states"][k].numpy(), want[key]), key
        order += batch["token_ids"].tolist()
    assert set(seen) == set(want) and set(seen.values()) == {1}, "every stored token exactly once"
    again = [t for b in DataLoader(ds, batch_size=None, num_workers=2) for t in b["token_ids"].tolist()]
    assert again == order, "the same order for the same seed"
    ds.set_epoch(1)
    other = [t for b in DataLoader(ds, batch_size=None, num_workers=2) for t in b["token_ids"].tolist()]
    assert other != order and sorted(other) == sorted(order), "another epoch: another order, the same tokens"


def test_the_loader_splits_ranks_and_bounds_its_buffer(states_run):
    from forge.data import token_states

    total = len(_stored(states_run, 4, "drop"))
    parts = []
    for rank in range(3):
        ds = token_states(
            states_run,
            layer=4,
            batch_size=16,
            shuffle_buffer=64,
            seed=0,
            rank=rank,
            world_size=3,
            with_ids=True,
            chunk_tokens=32,
        )
        parts.append({(i, p) for b in ds for i, p in zip(b["item_index"].tolist(), b["position"].tolist())})
        assert ds.max_pool_tokens <= 64 + 16 + 32 + 64  # the buffer, a batch, and one chunk of whole items
    assert sum(map(len, parts)) == total and len(set().union(*parts)) == total
    plain = next(iter(token_states(states_run, layer=4, batch_size=16, shuffle_buffer=64, dtype=torch.float16)))
    assert plain.shape == (16, 256) and plain.dtype == torch.float16


@pytest.mark.slow
def test_the_loader_reads_a_url(data):
    import fsspec

    from forge.data import token_states
    from forge.io.results import load

    url = "memory://forge-token-states/run"
    try:
        run_function("probe_gen", data[0], url, [*SMALL_LIMITS, *NONE, "shard_size=6"])
        stored = sum(len(t) for t in load(url, "activations").columns["token_ids"])
        ds = token_states(url, layer=0, batch_size=50, shuffle_buffer=100, with_ids=True)
        seen = collections.Counter((i, p) for b in ds for i, p in zip(b["item_index"].tolist(), b["position"].tolist()))
        assert len(seen) == stored > 0 and set(seen.values()) == {1}
    finally:
        fsspec.filesystem("memory").rm("/forge-token-states", recursive=True)


@pytest.mark.slow
def test_the_loader_refuses_what_the_run_did_not_store(states_run, tmp_path, data):
    from forge.data import token_states

    with pytest.raises(ForgeError, match=r"layer=3: the run stored layers \[0, 2, 4\]; choose one of them"):
        token_states(states_run, layer=3)
    with pytest.raises(ForgeError, match="prefix='all'; choose one of: drop, once, each"):
        token_states(states_run, layer=2, prefix="all")
    pooled = tmp_path / "pooled"
    run_function("probe_gen", data[0], pooled, [*SMALL_LIMITS, "layers=[2]", "input.limit=4"])
    with pytest.raises(ForgeError, match=r"holds pooled states \(pooling=last\); per-token states come from"):
        token_states(pooled, layer=2)
    bare = tmp_path / "bare"
    run_function("probe_gen", data[0], bare, [*SMALL_LIMITS, *NONE, "prefix_states=none", "input.limit=4"])
    with pytest.raises(ForgeError, match=r"prefix=each: the run stored no prefix states \(prefix_states=none\)"):
        token_states(bare, layer=2, prefix="each")
