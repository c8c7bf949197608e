"""The facts Forge reads from a model class are kept between runs, so `forge run`'s own process
need not import modeling code to check what it can run exactly (forge.runtime.model.class_facts)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import transformers

from forge.runtime.forward.encoder import encoder_capabilities
from forge.runtime.model.capabilities import capabilities
from forge.runtime.model.class_facts import ClassFacts, cache_path, class_facts, facts_of

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path))
    return tmp_path / "class_facts.json"


def test_facts_read_from_a_class_say_its_name_module_attention_and_mask_mapping():
    llama = facts_of(transformers.LlamaForCausalLM)
    assert llama == ClassFacts(
        "LlamaForCausalLM",
        "transformers.models.llama.modeling_llama",
        ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"),
        False,
    )
    gemma2 = facts_of(transformers.Gemma2ForCausalLM)
    assert gemma2.mask_mapping and not gemma2.supports_attn("sdpa") and gemma2.supports_attn("eager")
    assert facts_of(None).name is None


def test_the_first_read_is_kept_and_a_later_one_comes_from_the_cache(cache):
    config = transformers.LlamaConfig(**LLAMA)
    assert class_facts(config, "AutoModelForCausalLM") == facts_of(transformers.LlamaForCausalLM)
    kept = json.loads(cache.read_text())
    (key,) = kept
    assert "AutoModelForCausalLM" in key and transformers.__version__ in key and "LlamaConfig" in key
    kept[key]["supports"] = []  # what the cache says is what the check uses
    cache.write_text(json.dumps(kept))
    caps = capabilities(config)
    assert (caps.attn, caps.attn_note) == ("eager", "auto: no SDPA support")
    assert class_facts(config, "AutoModel").name == "LlamaModel"  # another loader, another entry
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.slow
def test_a_later_run_checks_capabilities_without_importing_modeling_code(cache):
    class_facts(transformers.LlamaConfig(**LLAMA), "AutoModelForCausalLM")
    code = textwrap.dedent(
        f"""
        import sys, transformers
        from forge.runtime.model.capabilities import capabilities
        caps = capabilities(transformers.LlamaConfig(**{LLAMA!r}))
        assert (caps.model_class, caps.model_module, caps.attn) == (
            "LlamaForCausalLM", "transformers.models.llama.modeling_llama", "sdpa"), caps
        print(sorted(m for m in sys.modules if m.endswith("modeling_llama") or m == "transformers.modeling_utils"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_broken_cache_file_is_read_afresh_and_rewritten(cache):
    cache.write_text("{not json")
    config = transformers.LlamaConfig(**LLAMA)
    assert class_facts(config, "AutoModelForCausalLM").name == "LlamaForCausalLM"
    assert len(json.loads(cache.read_text())) == 1
    cache.write_text("[1, 2]")  # valid JSON, not a table of facts
    assert class_facts(config, "AutoModelForCausalLM").name == "LlamaForCausalLM"


def test_an_unwritable_cache_still_gives_the_facts(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FORGE_CACHE", str(blocker / "below"))  # a directory cannot be made below a file
    assert class_facts(transformers.LlamaConfig(**LLAMA), "AutoModelForCausalLM").name == "LlamaForCausalLM"
    assert not cache_path().exists()


def test_a_config_outside_transformers_is_never_kept(cache):
    class OwnConfig(transformers.LlamaConfig):  # a model's own code defines its config class
        model_type = "own-llama"

    facts = class_facts(OwnConfig(**LLAMA), "AutoModelForCausalLM")
    assert facts.name is None and not cache.exists()
    assert not capabilities(OwnConfig(**LLAMA)).causal  # no causal LM class: nothing split or packed


def test_an_encoder_family_reads_its_automodel_class(cache):
    caps = encoder_capabilities(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    assert caps.model_class == "BertModel" and caps.attn == "sdpa"
    assert any("|AutoModel|" in key and "BertConfig" in key for key in json.loads(cache.read_text()))
