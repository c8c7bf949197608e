"""A model split over devices by a device map (`forge.runtime.placement.dispatch`) gives what the unsplit
model gives, in every row layout Forge's batching modes produce, for hidden states (probe_gen's
views), target log-probabilities (surprisal's) and per-item log-likelihoods (score's).

On a CPU-only machine the devices are "cpu" and "disk": accelerate keeps the disk blocks'
weights in the worker's offload folder and reads them back for each forward pass. Each family
is a tiny random-weight model (4 layers): its embeddings and first two layers on "cpu", its
last two layers, final norm and (untied) LM head on "disk". The modes, as the runner sees them:
batching=item runs rows of whole prompts; batching=token and batching=memory run the same rows,
rows after a split prefix (computed, then from the prefix cache), packed rows (after a split
prefix, or of whole prompts) and tree rows (prefix groups in the row). On a machine with CUDA the
same runs split over "cpu" and "cuda:0" (the "cpu" blocks offloaded to cuda:0, or computed on the
CPU beside the GPU's: activations and KV on two devices at once).
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from forge.runtime.forward.causal_lm import CausalLMRunner  # noqa: E402
from forge.runtime.forward.request import Forward  # noqa: E402
from forge.runtime.forward.scoring import ScoreRunner  # noqa: E402
from forge.runtime.forward.views import CausalViews  # noqa: E402
from forge.runtime.placement.dispatch import OFFLOAD_PREFIX, Dispatch, input_device, kept_map, places_itself  # noqa: E402
from forge.runtime.tokens.prompts import ItemMeta  # noqa: E402
from forge.vocab.geometry import Batch, Item  # noqa: E402

SAME = 1e-5  # split vs unsplit, the same layout
TOL = 1e-4  # either vs a plain one-prompt forward pass (the repository's float32 tolerance)
VOCAB = 300
LAYERS = 4
READ = [0, 2, LAYERS]  # hidden-state indices read (embeddings, a middle layer, the final output)
BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.2,
    pad_token_id=0,
)
FAMILIES = {
    "llama": ("LlamaConfig", dict()),
    "qwen2": ("Qwen2Config", dict()),
    "phi3": ("Phi3Config", dict()),
    "gpt_neox": ("GPTNeoXConfig", dict()),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=LAYERS, n_head=4, n_positions=256)),  # tied LM head
    "mistral-window": ("MistralConfig", dict(sliding_window=8)),  # windows shorter than prefix + text
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=8)),  # soft-capping, alternating windows
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def tiny(family: str):
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **extra})).eval()


def cpu_disk_map(model) -> dict[str, str]:
    """Embeddings and the first half of the layers on "cpu"; the rest on "disk" (a tied LM head
    stays with the embeddings it shares its weight with)."""
    base = model.get_decoder()
    prefix = next(n for n, m in model.named_modules() if m is base)
    out: dict[str, str] = {}
    seen_layers = False
    for name, child in base.named_children():
        if isinstance(child, torch.nn.ModuleList):
            seen_layers = True
            for i in range(len(child)):
                out[f"{prefix}.{name}.{i}"] = "cpu" if i < len(child) // 2 else "disk"
        else:
            out[f"{prefix}.{name}"] = "disk" if seen_layers else "cpu"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, _ in model.named_children():
        if name != prefix:
            out[name] = "cpu" if tied else "disk"
    return out


def _items(prefix_len: int, key: str | None, n: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(prefix_len)]
    out = []
    for j in range(n):
        tokens = prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 12))]
        start = max(prefix_len, 1)
        meta = ItemMeta(tuple(tokens[start:]), start - 1)
        out.append(Item(f"{key}-{j}", len(tokens), key, prefix_len, tokens, meta, seed * 10 + j))
    return out


def layouts() -> dict[str, Batch]:
    """Every row layout of the batching modes, over items that share a 13-token prefix and others."""
    items = _items(13, "a", 5, 1)
    other = _items(6, "b", 2, 2) + _items(0, None, 2, 3)
    P = 13
    own = max(it.num_tokens - P for it in items)
    packed = [items[:3], items[3:]]
    width = max(sum(it.num_tokens - P for it in row) for row in packed)
    whole = [other[:2], other[2:]]
    tree_rows = [items[:3] + other[:2], items[3:] + other[2:]]
    tree_width = max(
        sum(it.num_tokens - it.prefix_len for it in row) + sum({it.prefix_key: it.prefix_len for it in row}.values())
        for row in tree_rows
    )
    return {
        "rows (item)": Batch([[it] for it in items + other], max(it.num_tokens for it in items + other) + 2),
        "split prefix": Batch([[it] for it in items], own + 1, "a", P, split_prefix=True),
        "split prefix, cache hit": Batch([[it] for it in items], own + 1, "a", P, split_prefix=True),
        "split prefix, packed": Batch(packed, width + 3, "a", P, split_prefix=True, packed=True),
        "packed rows": Batch(whole, max(sum(it.num_tokens for it in r) for r in whole) + 1, packed=True),
        "tree rows": Batch(tree_rows, tree_width + 2, packed=True, tree=True),
    }


def _views(runner, batch) -> dict[str, dict]:
    views = CausalViews(runner, Forward(layers=tuple(READ), targets=True)).run(batch).views
    return {v.id: {**{f"h{k}": t.float().cpu() for k, t in v.hidden.items()}, "lp": v.logprobs.cpu()} for v in views}


def _reference(model, item: Item) -> dict:
    """A plain one-prompt transformers forward pass: the item's own tokens' states, its targets' log-probs."""
    ids = torch.tensor([list(item.tokens)])
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    own = {f"h{k}": out.hidden_states[k][0, item.prefix_len :].float() for k in READ}
    start = item.meta.target_start
    logp = torch.log_softmax(out.logits[0].float(), -1)[start : start + len(item.meta.targets)]
    return {**own, "lp": logp.gather(1, torch.tensor(item.meta.targets)[:, None])[:, 0]}


def _worst(got: dict, want: dict) -> float:
    return max((got[k][key] - want[k][key]).abs().max().item() for k in want for key in want[k])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> the directory its tiny model is saved in (once)."""
    root = tmp_path_factory.mktemp("split-models")
    made: dict[str, object] = {}

    def path(family: str):
        if family not in made:
            made[family] = root / family
            tiny(family).save_pretrained(made[family])
        return made[family]

    return path


def load(path, device_map: dict[str, str], offload: str, layers: int | None = None, main: str | None = None):
    """(the model saved at `path`, read by the worker's way onto the map's devices; its Dispatch)."""
    from forge.runtime.model.spec import HFModel, ModelSpec

    dispatch = Dispatch(device_map, offload, layers=layers, main=main)
    return dispatch.load(HFModel(ModelSpec(name=str(path))), transformers.AutoModelForCausalLM, None), dispatch


def _runners(saved, family: str, second: str = "disk", main: str | None = None):
    """(the model, its runner, the runner of it loaded split over "cpu" and `second`, its dispatch)."""
    whole = tiny(family)
    device_map = {name: second if dev == "disk" else dev for name, dev in cpu_disk_map(whole).items()}
    offload = "disk" if second == "disk" else "cpu"
    split, dispatch = load(saved(family), device_map, offload, main=main)  # a main device: placed by Forge itself
    kw = dict(layers=READ, cache_tokens=4096, pad_token_id=0)
    return whole, CausalLMRunner(whole, **kw), CausalLMRunner(split, **kw), dispatch


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_model_split_over_cpu_and_disk_equals_the_unsplit_one_in_every_layout(saved, family):
    _check_split(saved, family, "disk", None, SAME)


def test_a_model_read_into_host_memory_and_placed_with_its_main_device_said_equals_the_unsplit_one(saved):
    """`Dispatch.load` places the model itself where the main device matters (`places_itself`)."""
    assert places_itself({"a": "cuda:0", "b": "cuda:1", "c": "cpu"}, None)
    assert not places_itself({"a": "cuda:0", "b": "cuda:1"}, None) and not places_itself(
        {"a": "cuda:0", "b": "cpu"}, None
    )
    assert places_itself({"a": "cpu", "b": "disk"}, "cpu")
    _check_split(saved, "qwen2", "disk", "cpu", SAME)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@GPU
@pytest.mark.parametrize("main", [None, "cpu"])  # "cpu" blocks offloaded to cuda:0 | computed on the CPU
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_a_model_split_over_cpu_and_cuda_equals_the_unsplit_one_in_every_layout(saved, family, main):
    _check_split(saved, family, "cuda:0", main, TOL)  # CPU and CUDA kernels round differently


def _check_split(saved, family: str, second: str, main: str | None, same: float) -> None:
    whole, plain, split, dispatch = _runners(saved, family, second, main)
    try:
        assert set(split.model.hf_device_map.values()) == {"cpu", second}
        assert split.causal == plain.causal
        worst: dict[str, tuple[float, float]] = {}
        for name, batch in layouts().items():
            try:
                want = _views(plain, batch)
            except ValueError as refused:  # a layout this family cannot run exactly: refused alike when split
                with pytest.raises(ValueError, match=str(refused).split(":")[0]):
                    _views(split, batch)
                continue
            got = _views(split, batch)
            ref = {it.id: _reference(whole, it) for it in batch.items}
            worst[name] = (_worst(got, want), _worst(got, ref))
            assert worst[name][0] <= same and worst[name][1] <= TOL, (family, name, worst[name])
            score_got, score_want = ScoreRunner(split).run(batch), ScoreRunner(plain).run(batch)
            assert abs(score_got.loglik - score_want.loglik).max() <= same
            assert (score_got.greedy == score_want.greedy).all()
        assert split.cache.hits >= 1 and plain.cache.hits == split.cache.hits
        print(family, {k: f"{a:.1e}/{b:.1e}" for k, (a, b) in worst.items()})  # split-unsplit / split-reference
    finally:
        dispatch.close()


def test_a_model_placed_in_memory_puts_blocks_on_both_devices_and_its_offload_folder_goes_at_close():
    whole = tiny("llama")
    model = copy.deepcopy(whole)
    dispatch = Dispatch(cpu_disk_map(model), offload="disk")
    plain, split = CausalLMRunner(whole, layers=READ), CausalLMRunner(model, layers=READ, place=dispatch.place)
    folder = dispatch.folder
    assert folder and os.path.basename(folder).startswith(OFFLOAD_PREFIX) and os.listdir(folder)
    placed = split.model.hf_device_map
    assert placed["model.layers.0"] == "cpu" and placed["model.layers.3"] == "disk"
    assert next(split.model.model.layers[3].parameters()).device.type == "meta"  # its weights live on disk
    assert input_device(split.model) == torch.device("cpu")
    batch = layouts()["split prefix, packed"]
    assert _worst(_views(split, batch), _views(plain, batch)) <= SAME
    dispatch.close()
    assert not os.path.exists(folder)
    dispatch.close()  # twice is harmless


def test_the_layers_cut_before_an_in_memory_placement_are_never_placed():
    model = tiny("llama")
    dispatch = Dispatch(cpu_disk_map(model), offload="disk")
    try:
        runner = CausalLMRunner(model, layers=[1], stop_after_deepest=True, place=dispatch.place)
        assert runner.layers_run == 2
        assert set(model.hf_device_map) == {"model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"} | {
            "model.rotary_emb",
            "lm_head",
        }
        assert not any(".layers.2." in f or ".layers.3." in f for f in os.listdir(dispatch.folder))
    finally:
        dispatch.close()


def test_a_map_that_leaves_a_weight_unplaced_or_offloads_to_disk_unallowed_is_refused():
    model = tiny("llama")
    partial = {k: v for k, v in cpu_disk_map(model).items() if k != "model.layers.1"}
    with pytest.raises(ValueError, match=r"device_map places no module holding model\.layers\.1\..*forge plan"):
        kept_map(model, partial)
    no_rotary = {k: v for k, v in cpu_disk_map(model).items() if k != "model.rotary_emb"}  # buffers alone
    assert kept_map(model, no_rotary)["model.rotary_emb"] == "cpu"  # on the main device
    with pytest.raises(ValueError, match=r"offloads model\.layers\.2 to disk but the group allows offload=None"):
        Dispatch(cpu_disk_map(model), offload=None)


def test_a_group_devices_worker_reads_its_model_cut_onto_the_plans_devices_and_removes_its_folder_at_close(
    monkeypatch,
):
    """`CausalLMFunction.open_worker` on a device with a group loads the model by the plan's map
    (`forge.runtime.placement.device_map.placement_for`, here a stand-in: a cpu/disk map, the layers past the
    cut and the unread head "unused"): only the layers run are read, and results equal one device's."""
    import types

    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.runtime.model.embedded import embedded_dataset_path
    from forge.runtime.placement import device_map as placement_module

    path = str(embedded_dataset_path())
    fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=path), layers=[1]))
    layers = fn.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk"}
    device_map |= {f"model.layers.{i}": "cpu" if i < 1 else "disk" for i in range(layers)}
    unused = ("lm_head", *(f"model.layers.{i}" for i in range(2, layers)))  # probe_gen reads layer 1: runs 2
    placement = types.SimpleNamespace(device_map=device_map, max_memory={}, unused=unused, layers_run=2)
    monkeypatch.setattr(placement_module, "placement_for", lambda function, device: placement)

    items = [r for r in fn.records() if isinstance(r, Item)][:6]
    batch = Batch([[it] for it in items], max(it.num_tokens for it in items))
    group = types.SimpleNamespace(torch_device="cpu", group=("cpu", "disk"), offload="disk")
    single = types.SimpleNamespace(torch_device="cpu")
    split_worker, plain_worker = fn.open_worker(group, 0), fn.open_worker(single, 0)
    try:
        model = split_worker.views.runner.model
        assert len(model.model.layers) == 2 and split_worker.views.runner.layers_run == 2
        assert model.hf_device_map == {
            "model.embed_tokens": "cpu",
            "model.layers.0": "cpu",
            "model.layers.1": "disk",
            "model.norm": "disk",
            "model.rotary_emb": "cpu",
            "lm_head": "cpu",  # unread: left in host memory
        }
        folder = split_worker.closing.__self__.folder  # the worker closes its Dispatch
        assert folder and os.path.isdir(folder)
        got, want = split_worker.run(batch).columns, plain_worker.run(batch).columns
        assert set(got) == set(want) == {"layer_1"}
        assert want["layer_1"].shape == (6, fn.hidden_size) and abs(got["layer_1"] - want["layer_1"]).max() <= SAME
    finally:
        split_worker.close()
        plain_worker.close()
    assert not os.path.exists(folder)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_captures_and_interventions_on_a_split_model_equal_the_unsplit_ones(family):
    from forge.runtime.hooks.interventions import load_interventions

    whole = tiny(family)
    split = copy.deepcopy(whole)
    dispatch = Dispatch(cpu_disk_map(split), offload="disk")
    steer = [
        {"at": "resid_post.1", "op": "add", "vector": [0.5] * 32, "span": "text"},
        {"at": "mlp_out.3", "op": "zero", "span": "all"},  # a layer on disk
    ]
    points = ["resid_post.0", "attn_out.2", "resid_pre.3"]
    kw = dict(layers=READ, cache_tokens=4096, captures=points, interventions=load_interventions(steer))
    plain, placed = CausalLMRunner(whole, **kw), CausalLMRunner(split, place=dispatch.place, **kw)
    forward = Forward(layers=tuple(READ), capture=tuple(points))
    try:
        for name, batch in layouts().items():
            want = {v.id: v for v in CausalViews(plain, forward).run(batch).views}
            for v in CausalViews(placed, forward).run(batch).views:
                for point in points:
                    diff = (v.captured[point] - want[v.id].captured[point]).abs().max().item()
                    assert diff <= SAME, (family, name, point, diff)
                assert (v.hidden[LAYERS] - want[v.id].hidden[LAYERS]).abs().max().item() <= SAME
    finally:
        dispatch.close()


@pytest.mark.parametrize("how", ["load", "place"])
def test_an_encoder_split_over_cpu_and_disk_equals_the_unsplit_one_in_rows_and_packed_rows(tmp_path, how):
    """embed's encoder (a BERT, whole texts): embeddings and layer 0 on "cpu", the rest on "disk";
    read onto them from its checkpoint (the worker's way) or placed from host memory."""
    from forge.runtime.forward.encoder import EncoderViews, encoder_capabilities
    from forge.runtime.model.spec import HFModel, ModelSpec

    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    whole = transformers.BertModel(cfg).eval()
    device_map = {"embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "disk"}
    device_map |= {"encoder.layer.2": "disk", "pooler": "disk"}
    dispatch = Dispatch(device_map, offload="disk")
    if how == "load":
        whole.save_pretrained(tmp_path)
        split = dispatch.load(HFModel(ModelSpec(name=str(tmp_path))), transformers.AutoModel, "sdpa")
    else:
        split = dispatch.place(copy.deepcopy(whole))
    caps = encoder_capabilities(cfg, "sdpa")
    texts = _items(0, None, 6, 4)
    rows = Batch([[it] for it in texts], max(it.num_tokens for it in texts))
    width = max(sum(it.num_tokens for it in r) for r in (texts[:3], texts[3:]))
    packed = Batch([texts[:3], texts[3:]], width, packed=True)
    try:
        assert set(split.hf_device_map.values()) == {"cpu", "disk"}
        for batch in (rows, packed):
            want = {v.id: v.hidden for v in EncoderViews(whole, caps, [1, 3]).run(batch).views}
            for v in EncoderViews(split, caps, [1, 3]).run(batch).views:
                for layer in (1, 3):
                    assert (v.hidden[layer] - want[v.id][layer]).abs().max().item() <= SAME
    finally:
        dispatch.close()


@pytest.mark.slow  # the plan measures the function's memory model first
def test_a_group_the_plan_places_with_disk_offload_runs_as_the_single_device_does():
    """The whole path: `placement_for` plans a one-member CPU group too small for the model, with
    split.offload: disk; its worker's results equal a single device's, and the folder goes at close."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.runtime.model.embedded import embedded_dataset_path
    from forge.vocab.geometry import Device, Limits, Member

    fn = ProbeGen(
        ProbeGenConfig(
            model=ModelSpec(name="embedded:tiny-llama"),
            input=InputSpec(path=str(embedded_dataset_path())),
            layers=[1, 3],
        )
    )
    limits = Limits(max_batch_tokens=256, max_rows=64, max_seq_len=128)
    group = Device("group", limits, "cpu", group=(Member("cpu", int(0.8 * fn_weight_bytes(fn))),), offload="disk")
    items = [r for r in fn.records() if isinstance(r, Item)][:6]
    batch = Batch([[it] for it in items], max(it.num_tokens for it in items))
    want = fn.open_worker(Device("cpu", limits, "cpu"), 0).run(batch).columns
    worker = fn.open_worker(group, 0)
    try:
        placed = worker.views.runner.model.hf_device_map
        assert "disk" in placed.values() and set(placed.values()) <= {"cpu", "disk"}
        dispatch = worker.closing.__self__  # the worker closes its Dispatch
        folder = dispatch.folder
        got = worker.run(batch).columns
        assert all(abs(got[k] - want[k]).max() <= SAME for k in want) and set(got) == set(want)
    finally:
        worker.close()
    assert not os.path.exists(folder)


def fn_weight_bytes(fn) -> int:
    """The function's model's weight bytes (float32), from its config on the meta device."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(fn.config)
    return sum(p.numel() * 4 for p in model.parameters())


def test_a_model_loaded_cut_reads_only_the_layers_it_runs_and_keeps_the_whole_depths_indices(saved):
    whole = tiny("gemma2")  # alternating layer types: the config's list is cut and restored with the depth
    model, dispatch = load(saved("gemma2"), cpu_disk_map(whole), "disk", layers=2)
    try:
        assert len(model.model.layers) == 2 and model.config.num_hidden_layers == LAYERS
        assert len(model.config.layer_types) == LAYERS
        assert not any(".layers.2" in name or ".layers.3" in name for name in model.hf_device_map)
        runner = CausalLMRunner(model, layers=[1], stop_after_deepest=True)
        assert runner.layers_run == 2
        batch = layouts()["split prefix, packed"]
        plain = CausalLMRunner(whole, layers=[1], stop_after_deepest=True)
        assert (runner.run(batch).pooled[1] - plain.run(batch).pooled[1]).abs().max().item() <= SAME
        with pytest.raises(ValueError, match="loaded with 2 of its 4 layers, too few; plan it again"):
            CausalLMRunner(model, layers=[3], stop_after_deepest=True)
    finally:
        dispatch.close()
    assert not os.path.exists(dispatch.folder)


@pytest.mark.slow
def test_probe_gen_on_a_device_group_with_disk_offload_equals_one_item_at_a_time_in_every_mode(tmp_path):
    """End to end through `forge run`: a one-member CPU group too small for the embedded model, with
    split.offload: disk, runs probe_gen in every batching mode (item, token with and without the
    prefix cache, packed, memory-sized, merged tree rows) and each equals the plain one-item-at-a-time
    run within the repository's float32 tolerance (`forge.testing.check_modes`)."""
    import json

    from forge.functions.assets import embedded_dataset_path
    from forge.testing import check_modes

    rows = [json.loads(line) for line in open(embedded_dataset_path())][:16]
    group = "devices.inventory=[{name: g, devices: [cpu], memory_gb: 0.016, split: {offload: disk}}]"
    overrides = ["devices.discover=false", group, "layers=[1,4]"]  # layers 2-3 and the norm on disk
    check = check_modes("probe_gen", rows, tmp_path, tol=TOL, overrides=overrides, allow_skipped=True)
    assert not check.refused and set(check.worst) >= {"item", "token-cache", "token-packed", "memory"}, check.summary()
    assert len(check.reference) >= 10, check.summary()  # the rows over max_seq_len=128 are left out
