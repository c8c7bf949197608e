"""Embedded default assets of probe_gen: dataset, tokenizer, weightless model."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from forge.functions.assets import (
    ASSETS_DIR,
    embedded_dataset_path,
    embedded_model_source,
    materialize_model,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def rows():
    with open(embedded_dataset_path(), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_source())


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_import_is_cheap():
    # The assets module must not pull in torch/transformers at import time.
    import subprocess

    code = "import sys, forge.functions.assets; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ASSETS_DIR.parent.parent, check=True
    )
    assert out.stdout.strip() == "False"


def test_dataset_shape(rows):
    assert len(rows) >= 2000
    assert len({r["id"] for r in rows}) == len(rows)
    assert {r["label"] for r in rows} == {0, 1}
    n_true = sum(r["label"] for r in rows)
    assert 0.4 <= n_true / len(rows) <= 0.6
    for r in rows:
        assert isinstance(r["text"], str) and r["text"] and not r["text"][0].isspace()
    assert any("prefix" not in r for r in rows)


def test_prefixes(rows, tokenizer):
    prefixes = {r["prefix"] for r in rows if "prefix" in r}
    assert len(prefixes) >= 4
    for p in prefixes:
        assert p.endswith("\n")
    lengths = sorted(len(tokenizer(p, add_special_tokens=False).input_ids) for p in prefixes)
    assert len(set(lengths)) == len(lengths)
    assert lengths[0] <= 40 and lengths[-1] >= 300


def test_prefix_text_boundary(rows, tokenizer):
    # Tokenizing prefix and text separately equals tokenizing the joined string.
    for r in rows[:300]:
        if "prefix" not in r:
            continue
        joined = tokenizer(r["prefix"] + r["text"], add_special_tokens=False).input_ids
        split = (
            tokenizer(r["prefix"], add_special_tokens=False).input_ids
            + tokenizer(r["text"], add_special_tokens=False).input_ids
        )
        assert joined == split, r["id"]


def test_tokenizer(tokenizer):
    assert tokenizer.is_fast
    assert len(tokenizer) == 2048
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id is not None
    text = "The capital of France is Paris."
    with_special = tokenizer(text).input_ids
    without = tokenizer(text, add_special_tokens=False).input_ids
    assert with_special == [tokenizer.bos_token_id] + without
    assert tokenizer.bos_token_id not in without
    assert tokenizer.decode(without) == text
    batch = tokenizer(["a b", text], padding=True)
    assert batch["input_ids"][0][-1] == tokenizer.pad_token_id

    cfg = json.loads((embedded_model_source() / "config.json").read_text())
    assert cfg["vocab_size"] == len(tokenizer)
    assert cfg["bos_token_id"] == tokenizer.bos_token_id
    assert cfg["eos_token_id"] == tokenizer.eos_token_id
    assert cfg["pad_token_id"] == tokenizer.pad_token_id


def test_source_has_no_weights():
    src = embedded_model_source()
    assert (src / "forge_init.json").is_file()
    assert not (src / "model.safetensors").exists()
    assert not (src / "pytorch_model.bin").exists()


@pytest.mark.slow
def test_materialize_deterministic_and_loadable(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = embedded_model_source()
    rng_before = torch.random.get_rng_state()
    d1 = materialize_model(src, tmp_path / "a")
    assert torch.equal(rng_before, torch.random.get_rng_state())  # caller RNG untouched
    d2 = materialize_model(src, tmp_path / "b")
    assert d1 != d2
    assert d1.parent == tmp_path / "a" / "models" and d1.name.startswith("tiny-llama-")
    assert _sha256(d1 / "model.safetensors") == _sha256(d2 / "model.safetensors")

    # Cached: second call returns the same dir without rebuilding.
    mtime = (d1 / "model.safetensors").stat().st_mtime_ns
    assert materialize_model(src, tmp_path / "a") == d1
    assert (d1 / "model.safetensors").stat().st_mtime_ns == mtime
    # A dir with weights is returned as-is.
    assert materialize_model(d1, tmp_path / "c") == d1
    assert not (tmp_path / "c").exists()

    model = AutoModelForCausalLM.from_pretrained(d1)
    assert model.config.num_hidden_layers == 4
    assert model.config.hidden_size == 256
    assert model.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(d1)
    enc = tok(["The capital of France is Paris."], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    assert len(out.hidden_states) == 5
    assert out.hidden_states[-1].shape == (1, enc["input_ids"].shape[1], 256)


def test_materialize_env_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path))
    d = materialize_model(embedded_model_source())
    assert d.parent == tmp_path / "models"
    assert (d / "model.safetensors").is_file()


def test_materialize_passthrough(tmp_path):
    assert materialize_model("some-org/some-model", tmp_path) == "some-org/some-model"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert materialize_model(plain, tmp_path) == plain
    assert not (tmp_path / "models").exists()
