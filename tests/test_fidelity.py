"""The fidelity matrix: model families x batching modes, through the normal `forge run` path.

Each family is a tiny random-weight model built from its transformers config class (2 layers,
hidden 32, the embedded tokenizer's 2,048-token vocabulary), saved with the embedded tokenizer
and run with `model=hf model.name=DIR`. Every mode must give what a plain one-prompt-at-a-time
forward pass gives (float32: within 1e-4), or be refused before any work with a one-line
ForgeError naming the reason and the mode that works.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import compose  # noqa: E402
from forge import load_activations  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.testing import MODES as TESTING_MODES  # noqa: E402

LAYERS = [1, 2]
TOL = 1e-4
# reduced precision, against a one-prompt reference in the same dtype
COS_MIN = 0.999  # per vector
REL_MAX = 0.01  # per vector: max |got - want| <= REL_MAX * ||want||
WINDOW = 16  # sliding windows smaller than prefix + text (prefixes are 24 and 58 tokens)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=2048,
    max_position_embeddings=256,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    initializer_range=0.2,
)

FAMILIES = {
    "llama": ("LlamaConfig", dict()),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", dict()),
    "gpt_neox": ("GPTNeoXConfig", dict()),  # Pythia
    "falcon": ("FalconConfig", dict()),
    "falcon-alibi": ("FalconConfig", dict(alibi=True)),
    "stablelm": ("StableLmConfig", dict()),
    "granite": ("GraniteConfig", dict()),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=None)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    "olmo2": ("Olmo2Config", dict()),
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32)),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4)),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=WINDOW)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    # attention sinks, mixture of experts and alternating sliding / full layers
    "gpt_oss": (
        "GptOssConfig",
        dict(
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # multi-head latent attention: keys and values of different head sizes
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
}

# forge.testing's modes (every layout), with small prefix groups merged into tree rows by a
# window of 4 items (a step costs so much that all of them merge)
MODES = {
    **TESTING_MODES,
    "token-merged": ["batching=token", "batching.window=4", "batching.batch_overhead_tokens=100000"],
}
# (mode, pooling) pairs run for every family: every mode once, both poolings on the prefix paths
CASES = [
    ("item", "last"),
    ("item", "mean"),
    ("token-cache", "last"),
    ("token-cache", "mean"),
    ("token-nocache", "mean"),
    ("token-packed", "last"),
    ("token-packed", "mean"),
    ("memory", "last"),
    ("token-merged", "last"),
]
# refused before work, with the reason the message must name
REFUSED = {("bloom", "token-packed"): "ALiBi", ("falcon-alibi", "token-packed"): "ALiBi"}
SMALL = [
    "devices=auto",
    "devices.limits.max_batch_tokens=256",
    "devices.limits.max_seq_len=128",
    "budget.tokens_per_step=256",
    f"layers=[{','.join(map(str, LAYERS))}]",
]


def _rows() -> list[dict]:
    """18 rows: two prefixes (24 and 58 tokens) x 8 texts of 6..25 tokens, and 2 rows without one."""
    from forge.functions.assets import embedded_dataset_path

    rows = [json.loads(line) for line in open(embedded_dataset_path())]
    prefixes = [p for p in dict.fromkeys(r.get("prefix") for r in rows) if p]
    short, mid = sorted(prefixes, key=len)[:2]
    texts = [r["text"] for r in rows[:40]]
    out = []
    for j in range(16):
        text = " ".join(texts[j : j + 1 + j % 3])  # 1..3 statements
        out.append({"id": f"r{j}", "text": text, "prefix": short if j % 2 else mid, "label": j % 2})
    out += [{"id": "np0", "text": texts[30], "label": 0}, {"id": "np1", "text": " ".join(texts[31:33]), "label": 1}]
    return out


def _config(name: str, num_layers: int | None = None):
    cls_name, kwargs = FAMILIES[name]
    kwargs = dict(kwargs)
    if num_layers is not None:  # (hybrid attention: one type per layer)
        kwargs["num_hidden_layers"] = num_layers
        if "layer_types" in kwargs:
            kwargs["layer_types"] = (list(kwargs["layer_types"]) * num_layers)[:num_layers]
    return getattr(transformers, cls_name)(**{**BASE, **kwargs})


def _build(name: str, root: Path, num_layers: int | None = None) -> Path:
    return _save(_config(name, num_layers), root / (name if num_layers is None else f"{name}-{num_layers}"))[0]


def _save(cfg, path: Path):
    """(path, model): a random-weight model of `cfg` (seed 0) saved there with the embedded tokenizer."""
    from forge.functions.assets import embedded_model_source

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(embedded_model_source() / f, path / f)
    return path, model


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return root, path


_FAMILY_CACHE: dict[tuple[str, str], tuple[Path, dict]] = {}


def family(name: str, data, dtype: str = "float32"):
    """(model dir, {item id: {pooling: {layer: reference vector}}}), built once per module."""
    key = (name, dtype)
    if key not in _FAMILY_CACHE:
        root, rows = data
        path = _FAMILY_CACHE[(name, "float32")][0] if (name, "float32") in _FAMILY_CACHE else _build(name, root)
        from forge.api import InputSpec, ModelSpec
        from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
        from forge.runtime.forward.reference import pool, reference_hidden

        fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(path)), input=InputSpec(path=str(rows)), layers=LAYERS))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        refs = {}
        for item in fn.records():
            hidden = reference_hidden(model, item.tokens, LAYERS)
            refs[item.id] = {p: {L: pool(h, item.prefix_len, p) for L, h in hidden.items()} for p in ("last", "mean")}
        _FAMILY_CACHE[key] = (path, refs)
    return _FAMILY_CACHE[key]


_COMPOSED: dict[tuple, object] = {}


def _run(tmp_path, path, rows, mode, pooling, *extra):
    """`forge run` in-process; Hydra composes each (mode, pooling, extra) once, the model name is set after."""
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    key = (mode, pooling, extra, str(rows))
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(
            *SMALL,
            *MODES[mode],
            "model=hf",
            "model.name=DIR",
            f"input.path={rows}",
            f"pooling={pooling}",
            "runtime.executor=inprocess",
            *extra,
        )
    cfg = copy.deepcopy(_COMPOSED[key])
    cfg.model.name = str(path)
    return execute(build_spec(cfg, tmp_path), make_plugin_manager())


@pytest.mark.slow
@pytest.mark.parametrize("mode,pooling", CASES, ids=[f"{m}-{p}" for m, p in CASES])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fidelity_float32(tmp_path, data, name, mode, pooling):
    path, refs = family(name, data)
    rows = data[1]
    if (name, mode) in REFUSED:
        with pytest.raises(ForgeError, match=REFUSED[name, mode]) as err:
            _run(tmp_path, path, rows, mode, pooling)
        message = str(err.value)
        assert "\n" not in message and "use batching." in message
        assert not (tmp_path / "report.json").exists()  # refused before any work
        return
    report = _run(tmp_path, path, rows, mode, pooling, f"capture=[{','.join(CAPTURE)}]")
    assert report["items"]["completed"] == len(refs) and report["items"]["failed"] == 0, report.get("failures")
    assert report["balanced"], report["imbalance"]
    assert report["path"].startswith(f"{_family_type(path)}: ")
    if mode == "token-merged":  # tree rows ran, unless packed rows are not exact for the family
        trees = sum(d["tree_batches"] for d in report["devices"])
        assert (trees > 0) == ((name, "token-packed") not in REFUSED), trees
    ids, _, layers = load_activations(tmp_path)
    for layer in LAYERS:
        want = torch.stack([refs[i][pooling][layer] for i in ids])
        diff = (layers[layer] - want).abs().max().item()
        assert diff < TOL, (name, mode, pooling, layer, diff, report["path"])
    # the hook points captured beside them (probe_gen capture=[...], pooled alike): plain transformers hooks
    from forge.io.results import load

    captured, hooked = load(tmp_path, "activations"), capture_reference(name, data)
    for point in CAPTURE:
        for rid, got in zip(captured.ids, captured.columns[point]):
            own = hooked[rid][point]
            want = own[-1] if pooling == "last" else own.mean(dim=0)
            diff = (torch.as_tensor(got).float() - want).abs().max().item()
            assert diff < TOL, (name, mode, pooling, point, rid, diff)


# -- capture at hook points: plain transformers forward hooks on the same modules -----------------
CAPTURE = ("attn_out.0", "mlp_out.1")
ATTN_BLOCK = r"(self_attn|attn|attention|self_attention)"
MLP_BLOCK = r"(mlp|feed_forward|block_sparse_moe|fc2)"  # OPT: no MLP block, its second projection
_CAPTURE_REFS: dict[str, dict] = {}


def _hook_module(model, kind: str, layer: int):
    """The module a point names, found here by its path: <...>.(layers|h).<layer>.<block>."""
    import re

    pattern = re.compile(rf"(^|\.)(layers|h)\.{layer}\.{ATTN_BLOCK if kind == 'attn_out' else MLP_BLOCK}$")
    found = [m for n, m in model.named_modules() if pattern.search(n)]
    assert len(found) == 1, (kind, layer, [n for n, _ in model.named_modules() if pattern.search(n)])
    return found[0]


def capture_reference(name: str, data) -> dict:
    """{item id: {point: [own tokens, hidden]}} from one-prompt forward passes with hooks."""
    if name not in _CAPTURE_REFS:
        path, _ = family(name, data)
        from forge.api import InputSpec, ModelSpec
        from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

        fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(path)), input=InputSpec(path=str(data[1])), layers=[1]))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        seen: dict[str, torch.Tensor] = {}
        for point in CAPTURE:
            kind, _, layer = point.partition(".")
            keep = (lambda key: lambda m, a, out: seen.__setitem__(key, out[0] if isinstance(out, tuple) else out))(
                point
            )
            _hook_module(model, kind, int(layer)).register_forward_hook(keep)
        refs = {}
        with torch.inference_mode():
            for item in fn.records():
                model(input_ids=torch.as_tensor(item.tokens, dtype=torch.long)[None], use_cache=False)
                per_token = {p: v.reshape(-1, v.shape[-1]) for p, v in seen.items()}  # OPT's MLP: [tokens, hidden]
                refs[item.id] = {p: per_token[p][item.prefix_len :].clone() for p in CAPTURE}
        _CAPTURE_REFS[name] = refs
    return _CAPTURE_REFS[name]


# the prefix cache path with rows attending to one copy of the prefix's keys (forge.runtime.forward.
# shared_prefix) at every shape; families whose attention it cannot take exactly keep the cache path
NOT_SHARED = {  # by its one rule (`shared_prefix.eligible`), before any forward
    "bloom",  # ALiBi
    "falcon-alibi",
    "mistral-window",  # sliding windows
    "gemma2",
    "gemma3",
    "gpt_oss",
    "falcon",  # its attention does not go through transformers' attention interface
    "stablelm",
    "deepseek_v3",  # multi-head latent attention
}


def _run_shared(monkeypatch, tmp_path, path, rows, pooling, *extra) -> tuple[dict, list[bool]]:
    """token-cache with the shared-prefix attention asked at every shape: (report, per ask
    whether it ran)."""
    from forge.runtime.forward import shared_prefix

    ran = []
    forward = shared_prefix.forward
    monkeypatch.setattr(shared_prefix, "worth_sharing", lambda *a: True)
    monkeypatch.setattr(shared_prefix, "forward", lambda *a, **k: ran.append(forward(*a, **k)) or ran[-1])
    report = _run(tmp_path, path, rows, "token-cache", pooling, *extra)
    return report, [out is not None for out in ran]


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fidelity_shared_prefix_attention(tmp_path, data, name, pooling, monkeypatch):
    path, refs = family(name, data)
    report, took = _run_shared(monkeypatch, tmp_path, path, data[1], pooling)
    assert report["items"]["completed"] == len(refs) and report["balanced"]
    if name in NOT_SHARED:
        assert took == [], took  # refused by the rule before any forward
    else:
        assert took and all(took), took  # every cached-prefix batch ran through it (transformers 5)
    ids, _, layers = load_activations(tmp_path)
    for layer in LAYERS:
        want = torch.stack([refs[i][pooling][layer] for i in ids])
        diff = (layers[layer] - want).abs().max().item()
        assert diff < TOL, (name, pooling, layer, diff)


@pytest.mark.parametrize("name,dtype", [("llama", "bfloat16"), ("qwen2", "float16")])
def test_shared_prefix_attention_in_reduced_precision(tmp_path, data, name, dtype, monkeypatch):
    path, refs = family(name, data, dtype)
    report, took = _run_shared(monkeypatch, tmp_path, path, data[1], "mean", f"model.torch_dtype={dtype}")
    assert report["items"]["completed"] == len(refs) and took and all(took)
    ids, _, layers = load_activations(tmp_path)
    for layer in LAYERS:
        want = torch.stack([refs[i]["mean"][layer] for i in ids])
        got = layers[layer].float()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
        rel = ((got - want).abs().max(dim=-1).values / want.norm(dim=-1)).max().item()
        assert cos >= COS_MIN and rel <= REL_MAX, (name, dtype, layer, cos, rel)


def _family_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]


# -- reduced precision: against a one-prompt reference in the same dtype ------------------------
LOW_CASES = [
    ("llama", "bfloat16", "token-cache", "last"),
    ("llama", "float16", "token-packed", "mean"),
    ("mistral-window", "bfloat16", "token-packed", "last"),
    ("gemma2", "bfloat16", "token-cache", "mean"),
    ("gemma3", "bfloat16", "token-packed", "mean"),
    ("gpt2", "bfloat16", "token-packed", "last"),
    ("bloom", "bfloat16", "token-cache", "last"),
    ("qwen2_moe", "bfloat16", "memory", "mean"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,mode,pooling", LOW_CASES, ids=["-".join(c) for c in LOW_CASES])
def test_fidelity_reduced_precision(tmp_path, data, name, dtype, mode, pooling):
    path, refs = family(name, data, dtype)
    report = _run(tmp_path, path, data[1], mode, pooling, f"model.torch_dtype={dtype}")
    assert report["items"]["completed"] == len(refs) and report["items"]["failed"] == 0
    ids, _, layers = load_activations(tmp_path)
    for layer in LAYERS:
        want = torch.stack([refs[i][pooling][layer] for i in ids])
        got = layers[layer].float()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
        rel = ((got - want).abs().max(dim=-1).values / want.norm(dim=-1)).max().item()
        assert cos >= COS_MIN and rel <= REL_MAX, (name, dtype, mode, pooling, layer, cos, rel)


# -- capabilities, refusals and the stated path -------------------------------------------------
def test_path_is_stated(tmp_path, data):
    from forge.driver.plan import plan
    from forge.pluginmanager import make_plugin_manager

    path, _ = family("gemma2", data)
    report = _run(tmp_path, path, data[1], "token-packed", "last")
    assert report["path"].startswith("gemma2: eager attention (auto: no SDPA support); prefix run once")
    assert "packed rows on" in report["path"] and "sliding window 16 masked per layer type" in report["path"]
    from forge.cli.build import build_spec

    cfg = compose(
        *SMALL, "batching=token", "model=hf", f"model.name={family('llama', data)[0]}", f"input.path={data[1]}"
    )
    planned = plan(build_spec(cfg, None), make_plugin_manager())
    assert (
        planned["path"] == "llama: sdpa attention (auto: SDPA supported); prefix run once per batch; "
        "prefix cache on; packed rows off"
    )


def test_attn_implementation_override(tmp_path, data):
    path, refs = family("llama", data)
    report = _run(tmp_path, path, data[1], "token-packed", "last", "model.attn_implementation=eager")
    assert report["path"].startswith("llama: eager attention (set by model.attn_implementation)")
    ids, _, layers = load_activations(tmp_path)
    want = torch.stack([refs[i]["last"][2] for i in ids])
    assert (layers[2] - want).abs().max() < TOL
    with pytest.raises(ForgeError, match="attn_implementation=sdpa: gemma2 does not support it; use auto or eager"):
        _run(tmp_path / "x", family("gemma2", data)[0], data[1], "item", "last", "model.attn_implementation=sdpa")


def test_not_causal_refused_before_work(tmp_path, data):
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=2048
    )
    path = tmp_path / "bert"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    with pytest.raises(ForgeError) as err:
        _run(tmp_path / "run", path, data[1], "token-cache", "last")
    message = str(err.value)
    assert "not exact for bert: it is not causal (an encoder unless is_decoder=true)" in message
    assert "use batching.prefix_cache=false batching.packing=rows" in message and "\n" not in message
    assert not (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize("name", ["gpt2", "bloom", "gemma2", "gemma3", "mistral-window", "opt"])
def test_capabilities_from_config_alone(name):
    from forge.runtime.model.capabilities import capabilities

    cls_name, kwargs = FAMILIES[name]
    caps = capabilities(getattr(transformers, cls_name)(**{**BASE, **kwargs}))
    assert caps.causal and caps.refusal(True, False) is None
    assert caps.attn == ("eager" if name in ("bloom", "gemma2") else "sdpa")
    assert (caps.refusal(True, True) is None) == (name != "bloom")
    assert caps.windows == ((WINDOW,) if name in ("gemma2", "gemma3", "mistral-window") else ())
    assert caps.mixed_layers == (name in ("gemma2", "gemma3"))
    assert caps.learned_positions == (name in ("gpt2", "opt"))


# state-space, recurrent, convolutional and linear-attention layers: their state after a prefix is
# not a key/value cache that rows can read, nor can a mask keep packed sequences apart in them
RECURRENT = {
    "mamba": ("MambaConfig", dict(state_size=4, expand=2, conv_kernel=4), "linear_attention"),
    "jamba": (
        "JambaConfig",
        dict(num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4),
        "linear_attention",
    ),
    "falcon_h1": (
        "FalconH1Config",
        dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4, mamba_n_groups=1, head_dim=8),
        "hybrid",
    ),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        dict(lru_width=32, attention_window_size=16, block_types=["recurrent", "attention"], head_dim=8),
        "linear_attention",
    ),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention"], block_ff_dim=64), "conv"),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(layer_types=["linear_attention", "full_attention"], head_dim=8, num_experts=2, num_experts_per_tok=1),
        "linear_attention",
    ),
}


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_and_hybrid_layers_refuse_every_shared_or_packed_layout(name):
    from forge.runtime.model.capabilities import capabilities

    cls_name, kwargs, kind = RECURRENT[name]
    caps = capabilities(getattr(transformers, cls_name)(**{**BASE, **kwargs}))
    assert caps.causal and caps.refusal(False, False) is None  # whole prompts per row run
    for split, packed in ((True, False), (False, True), (True, True)):
        assert f"it has {kind} (" in caps.refusal(split, packed)
        assert "layers, which keep no plain key/value cache" in caps.refusal(split, packed)
    with pytest.raises(
        ForgeError, match=rf"^batching.prefix_cache=true is not exact for {name}: .* use batching.prefix"
    ):
        caps.check(True, False)


@pytest.mark.parametrize("mode", ["item", "token-nocache"])
@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_recurrent_and_hybrid_families_run_whole_prompts_exactly(tmp_path, data, name, mode):
    from forge.runtime.forward.reference import pool, reference_hidden

    cls_name, kwargs, _ = RECURRENT[name]
    path, model = _save(getattr(transformers, cls_name)(**{**BASE, **kwargs}), tmp_path / name)
    report = _run(tmp_path / "run", path, data[1], mode, "mean")
    assert report["items"]["failed"] == 0 and report["balanced"]
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(path)), input=InputSpec(path=str(data[1])), layers=LAYERS))
    want = {it.id: (it.prefix_len, reference_hidden(model, it.tokens, LAYERS)) for it in fn.records()}
    ids, _, layers = load_activations(tmp_path / "run")
    for layer in LAYERS:
        ref = torch.stack([pool(want[i][1][layer], want[i][0], "mean") for i in ids])
        assert (layers[layer] - ref).abs().max().item() < TOL, (name, mode, layer)


def test_remote_code_needs_consent(tmp_path):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "forge_custom_lm",
                "num_hidden_layers": 2,
                "auto_map": {
                    "AutoConfig": "configuration_custom.CustomConfig",
                    "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
                },
            }
        )
    )
    with pytest.raises(
        ForgeError, match="needs its repository's own code; if you trust it, set model.trust_remote_code=true"
    ):
        ProbeGen(
            ProbeGenConfig(model=ModelSpec(name=str(tmp_path)), input=InputSpec(path="embedded:statements"), layers=[1])
        )


def test_eos_appending_tokenizer(tmp_path, data):
    """A tokenizer that appends EOS: the prefix loses it (it would sit inside the prompt), once warned."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    path, _ = family("llama", data)
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    tok = json.loads((eos_dir / "tokenizer.json").read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "</s>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
            "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]},
        },
    }
    (eos_dir / "tokenizer.json").write_text(json.dumps(tok))
    fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(eos_dir)), input=InputSpec(path=str(data[1])), layers=LAYERS))
    items = list(fn.records())
    assert fn.tokenizer("a b")["input_ids"][-1] == 2  # the tokenizer does append EOS
    for item in items:
        if item.prefix_len:
            assert 2 not in item.tokens and item.tokens[0] == 1
        else:
            assert item.tokens[-1] == 2  # a row without a prefix keeps the tokenizer's own EOS
    assert sum("appends EOS" in w for w in fn.warnings()) == 1


# -- surprisal: target log-probabilities through the same matrix --------------------------------
_SURPRISAL_REFS: dict[str, dict] = {}


def _surprisal_refs(name: str, data) -> dict:
    """{item id: (sum_nll, num_tokens)} from the family's full forward pass, one row at a time."""
    if name not in _SURPRISAL_REFS:
        path, _ = family(name, data)
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs = {}
        for row in _rows():
            if row.get("prefix"):
                prefix = tok(row["prefix"])["input_ids"]
                ids, first = prefix + tok(row["text"], add_special_tokens=False)["input_ids"], len(prefix)
            else:
                ids, first = tok(row["text"])["input_ids"], 1
            with torch.inference_mode():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
            nll = [-logp[p - 1, ids[p]].item() for p in range(first, len(ids))]
            refs[row["id"]] = (sum(nll), len(nll))
        _SURPRISAL_REFS[name] = refs
    return _SURPRISAL_REFS[name]


SURPRISAL_MODES = ["item", "token-cache", "token-nocache", "token-packed", "memory"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", SURPRISAL_MODES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_surprisal_fidelity_float32(tmp_path, data, name, mode):
    from forge.io.results import load

    path, _ = family(name, data)
    key = ("surprisal", mode)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(
            *SMALL[:-1],
            *MODES[mode],
            "function=surprisal",
            "model=hf",
            "model.name=DIR",
            f"input.path={data[1]}",
            "runtime.executor=inprocess",
        )
    cfg = copy.deepcopy(_COMPOSED[key])
    cfg.model.name = str(path)
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    if (name, mode) in REFUSED:
        with pytest.raises(ForgeError, match=REFUSED[name, mode]):
            execute(build_spec(cfg, tmp_path), make_plugin_manager())
        assert not (tmp_path / "report.json").exists()
        return
    report = execute(build_spec(cfg, tmp_path), make_plugin_manager())
    refs = _surprisal_refs(name, data)
    assert report["items"]["completed"] == len(refs) and report["items"]["failed"] == 0, report.get("failures")
    res = load(tmp_path)
    for k, rid in enumerate(res.ids):
        sum_nll, n = refs[rid]
        assert res.columns["num_tokens"][k] == n
        assert abs(res.columns["sum_nll"][k] - sum_nll) < TOL * n, (name, mode, rid)
        assert abs(res.columns["mean_nll"][k] - sum_nll / n) < TOL, (name, mode, rid)


# -- layers past the deepest one asked for ------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layers_past_the_deepest_asked_for_are_cut_exactly_in_every_family(name):
    """A 4-layer model of each family cut to its first 2 layers (`hf_compat.keep_first_layers`,
    what `probe_gen` asks for with layers up to 1): hidden states 0 and 1 are bit for bit those
    of the whole model, and state 2 is the cut model's last (its final norm)."""
    from forge.runtime.model.hf_compat import keep_first_layers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name, num_layers=4))
    base = model.eval().get_decoder()
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = base(input_ids=ids, output_hidden_states=True).hidden_states
        assert keep_first_layers(base, 4, 2)
        cut = base(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(whole) == 5 and len(cut) == 3
    for i in (0, 1):
        assert torch.equal(whole[i], cut[i]), (name, i)
    assert not keep_first_layers(base, 2, 2)  # nothing to cut
    # batching=memory prices the model that runs: the same parameters as the cut one
    from forge.runtime.cost.memory_fit import fake_model, state_bytes
    from forge.runtime.cost.models import config_as_run

    as_run = config_as_run(_config(name, num_layers=4), (1,))
    assert as_run.num_hidden_layers == 2 and state_bytes(fake_model(as_run)[1]) == state_bytes(model), name


@pytest.mark.parametrize("mode", ["token-cache", "token-merged"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_run_cut_past_the_deepest_layer_equals_one_prompt_at_a_time(tmp_path, data, name, mode, monkeypatch):
    """4 layers, states 1 and 2 asked for: the worker runs 3 layers (the prefix cache and tree rows
    as ever), and every vector equals the whole model's one-prompt-at-a-time forward pass."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.runtime.forward.reference import pool, reference_hidden

    root, rows = data
    path = root / f"{name}-4" if (root / f"{name}-4").exists() else _build(name, root, num_layers=4)
    if (name, "token-packed") in REFUSED and mode == "token-merged":
        pytest.skip("packed rows are not exact for the family: groups stay apart (test_fidelity_float32)")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(path)), input=InputSpec(path=str(rows)), layers=LAYERS))
    refs = {}
    for it in fn.records():
        refs[it.id] = {L: pool(h, it.prefix_len, "last") for L, h in reference_hidden(model, it.tokens, LAYERS).items()}
    from forge.runtime.forward.causal_lm import CausalLMRunner

    ran, init = [], CausalLMRunner.__init__
    monkeypatch.setattr(
        CausalLMRunner, "__init__", lambda self, *a, **k: init(self, *a, **k) or ran.append(self.layers_run)
    )
    report = _run(tmp_path, path, rows, mode, "last")
    assert ran == [3]  # of 4
    assert report["items"]["completed"] == len(refs) and report["balanced"], report.get("failures")
    ids, _, layers = load_activations(tmp_path)
    for layer in LAYERS:
        want = torch.stack([refs[i][layer] for i in ids])
        assert (layers[layer] - want).abs().max().item() < TOL, (name, mode, layer)


# -- tree rows after a root: prefixes that share their first tokens (few-shot shots, then a question) --
ROOT_FAMILIES = [
    "llama",
    "qwen3",
    "gpt_neox",
    "gpt2",
    "opt",
    "falcon",
    "mistral-window",  # the root is longer than the window: its far keys must be masked off
    "gemma2",
    "gemma3",
    "gpt_oss",
    "deepseek_v3",
]


@pytest.fixture(scope="module")
def root_rows(data):
    """12 rows in 6 prefix groups, each prefix the same 58-token shots and a question of its own."""
    shots = max((r["prefix"] for r in _rows() if "prefix" in r), key=len)
    texts = [r["text"] for r in _rows()]
    rows = [
        {"id": f"g{g}r{j}", "text": texts[2 * g + j], "prefix": f"{shots} Case {g}: {texts[g + 6][: 10 + 4 * g]}"}
        for g in range(6)
        for j in range(2)
    ]
    path = data[0] / "root_rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-merged", "token-cache", "token-packed"])
@pytest.mark.parametrize("name", ROOT_FAMILIES)
def test_prefixes_that_share_a_start_run_it_once_and_equal_one_prompt_at_a_time(
    tmp_path, data, root_rows, name, mode, monkeypatch
):
    """Tree rows run after the root their prefixes share, and a split prefix after the longest start of
    it the cache holds (forge.runtime.forward.tree_root, PrefixCache.longest_start): the shots run once.
    Each item still equals its one-prompt forward pass, sliding windows included; the ledger balances."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.runtime.forward.causal_lm import CausalLMRunner
    from forge.runtime.forward.prefix_cache import PrefixCache
    from forge.runtime.forward.reference import pool, reference_hidden

    path, _ = family(name, data)
    fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(path)), input=InputSpec(path=str(root_rows)), layers=LAYERS))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = {it.id: (reference_hidden(model, it.tokens, LAYERS), it.prefix_len) for it in fn.records()}
    starts: list[int] = []
    real = PrefixCache.longest_start
    monkeypatch.setattr(
        PrefixCache, "longest_start", lambda self, *a: (found := real(self, *a)) and starts.append(found[1]) or found
    )
    roots: list[int] = []
    root = CausalLMRunner._tree_root
    monkeypatch.setattr(CausalLMRunner, "_tree_root", lambda self, *a: roots.append(root(self, *a)) or roots[-1])
    report = _run(tmp_path, path, root_rows, mode, "mean")
    assert report["items"]["completed"] == len(refs) and report["balanced"], report.get("imbalance")
    assert report["tokens"]["cache_hit"] > 0
    if mode == "token-merged":  # every tree batch ran after the root (the first computed it, the rest hit)
        assert roots and min(roots) >= 48, roots
    else:  # each prefix after the first ran after the shots' keys another one held
        assert len(starts) >= 5 and min(starts) >= 48, starts
    ids, _, layers = load_activations(tmp_path)
    for layer in LAYERS:
        want = torch.stack([pool(refs[i][0][layer], refs[i][1], "mean") for i in ids])
        diff = (layers[layer] - want).abs().max().item()
        assert diff < TOL, (name, mode, layer, diff, report["path"])
