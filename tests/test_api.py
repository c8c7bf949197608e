"""The public function API is stable: its names, the fields authors read, and what it costs to import."""

import dataclasses
import subprocess
import sys

import forge
import forge.api as api

PUBLIC = [
    "Aggregate",
    "CausalLMFunction",
    "Column",
    "EncoderFunction",
    "Field",
    "ForgeError",
    "Forward",
    "GenerativeConfig",
    "GenerativeFunction",
    "InputSpec",
    "Item",
    "ItemView",
    "ModelFunction",
    "ModelFunctionConfig",
    "ModelSpec",
    "Prompt",
    "Rejected",
    "Row",
    "RowLimits",
    "SamplingConfig",
    "Tokens",
]


def test_the_public_names_are_exactly_these():
    assert sorted(api.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(forge, name) is getattr(api, name), name  # re-exported from forge
    # forge's names are its own, the in-process API's and forge.api's list (the one list of them)
    assert forge.__all__ == sorted({*forge.OWN_NAMES, *forge.INPROC_NAMES, *PUBLIC})


def test_the_item_view_and_specs_keep_their_fields():
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert names(api.ItemView) == [
        "id",
        "index",
        "tokens",
        "prefix_len",
        "hidden",
        "prefix_state",
        "targets",
        "logprobs",
        "greedy",
        "label",
        "data",
        "prefix_key",
        "captured",
        "logits",
        "final_head",
    ]
    assert names(api.Forward) == ["layers", "targets", "capture", "logits", "head"]
    assert names(api.Prompt) == ["text", "prefix", "label", "data", "suffix"]
    assert names(api.ModelSpec) == ["name", "torch_dtype", "attn_implementation", "revision", "trust_remote_code"]
    assert names(api.ModelFunctionConfig) == ["model", "input", "shard_size", "intervene"]
    assert names(api.Tokens) == ["prefix", "text", "prefix_key", "targets", "target_start"]


def test_the_bases_share_code_through_their_parent_not_a_sibling():
    assert api.CausalLMFunction.__bases__ == (api.ModelFunction,)
    assert api.EncoderFunction.__bases__ == (api.ModelFunction,)
    for method in ("rows", "records", "fingerprint", "describe", "result_schema", "open_sink", "reduce"):
        assert method not in vars(api.CausalLMFunction) and method not in vars(api.EncoderFunction), method


def test_import_forge_stays_light():
    code = (
        "import sys, forge; from forge import errors, vocab; import forge.config; "  # a submodule asks for nothing
        "assert 'torch' not in sys.modules and 'forge.api' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
