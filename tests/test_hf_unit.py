"""Hugging Face models and text data, in one process: the model factory, tokenizers, tokenize-once
caching, packing and padding, the held-out split, the stream and its windows, bad input, evaluation."""

from __future__ import annotations

import os
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import requires

requires("transformers")
requires("datasets")

from distaccum.config import EvalConfig, Split  # noqa: E402
from distaccum.data.global_batch import GlobalBatchOrder  # noqa: E402
from distaccum.data.pipeline import OrderSource  # noqa: E402
from distaccum.data.stream import StreamSource, StreamWindows  # noqa: E402
from distaccum.datasets import pad_collate  # noqa: E402
from distaccum.evaluate import eval_dataset, evaluate, shard_batches  # noqa: E402
from distaccum.hf import ByteTokenizer, causal_lm, load_tokenizer, model_loss  # noqa: E402
from distaccum.losses import token_cross_entropy  # noqa: E402
from distaccum.probe import probe  # noqa: E402
from distaccum.rundir import read_evals, read_metrics, truncate_metrics  # noqa: E402
from distaccum.textdata import TextFiles, TextStream, pack_blocks  # noqa: E402
from hf_corpus import OFFLINE, paragraphs, write_jsonl, write_text_files  # noqa: E402

pytestmark = pytest.mark.unit

for _key, _value in OFFLINE.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], str]:
    base = tmp_path_factory.mktemp("hfunit")
    return write_text_files(base / "text", count=120), str(base / "cache")


def tiny(**kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return causal_lm(width=32, heads=2, layers=1, positions=64, **kwargs)  # type: ignore[arg-type]


def test_random_init_llama_and_gpt2_follow_the_yaml_sizes() -> None:
    llama, gpt2 = tiny(), tiny(model_type="gpt2")
    assert type(llama).__name__ == "LlamaForCausalLM" and type(gpt2).__name__ == "GPT2LMHeadModel"
    assert llama.config.hidden_size == 32 and llama.config.num_hidden_layers == 1
    assert llama.config.max_position_embeddings == 64 and llama.get_input_embeddings().num_embeddings == 256
    assert gpt2.config.n_embd == 32 and gpt2.config.n_positions == 64 and gpt2.config.resid_pdrop == 0.0
    assert gpt2.config.eos_token_id is None  # gpt2's 50256 does not fit a byte vocabulary
    again = tiny()
    assert all(torch.equal(a, b) for a, b in zip(llama.parameters(), again.parameters(), strict=True))


def test_model_factory_errors_name_the_value_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_type='bert' is not supported"):
        causal_lm(model_type="bert")
    with pytest.raises(ValueError, match="width=30 is not divisible by model.heads=4"):
        causal_lm(width=30)
    with pytest.raises(ValueError, match="not a save_pretrained directory"):
        causal_lm(pretrained=str(tmp_path))


def test_pretrained_round_trip_reproduces_the_logits(tmp_path: Path) -> None:
    model = tiny()
    model.save_pretrained(str(tmp_path / "m"))
    loaded = causal_lm(pretrained=str(tmp_path / "m"))
    ids = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_tokenizers_bytes_or_a_local_directory(tmp_path: Path) -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok(["é!"])["input_ids"] == [[195, 169, 33]] and len(tok) == 256
    with pytest.raises(ValueError, match="is not a directory"):
        load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))


def test_packing_carries_tokens_across_documents() -> None:
    blocks = list(pack_blocks([[1, 2, 3], [4], [5, 6, 7, 8, 9]], 4, [0]))
    assert blocks == [[1, 2, 3, 0], [4, 0, 5, 6], [7, 8, 9, 0]]


def test_packed_blocks_are_the_text_bytes_and_tokenized_once(
    corpus: tuple[list[Path], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cache = corpus
    ds = TextFiles([str(f) for f in files], cache_dir=cache, block_size=32)
    text = "".join(p + "\n\n" for f in files for p in f.read_text().strip().split("\n\n"))
    assert len(ds) == len(text.encode()) // 32
    assert bytes(ds[1]["input_ids"].tolist()) == text.encode()[32:64]
    assert torch.equal(ds[3]["labels"], ds[3]["input_ids"])  # the loss shifts (shift=true)
    batch = ds.__getitems__([3, 0, 5])  # the DataLoader's one-read fetch gives the same samples
    assert all(torch.equal(b["input_ids"], ds[i]["input_ids"]) for b, i in zip(batch, (3, 0, 5), strict=True))
    texts: list[str] = []
    real = ByteTokenizer.__call__
    monkeypatch.setattr(ByteTokenizer, "__call__", lambda self, t, **k: texts.extend(t) or real(self, t, **k))
    again = TextFiles([str(f) for f in files], cache_dir=cache, block_size=32)
    assert set(texts) <= {"\n\n"} and len(again) == len(ds)  # the arrow cache, not tokenized again (only
    # the packing separator is)


def test_variable_length_samples_are_truncated_with_a_warning(corpus: tuple[list[Path], str]) -> None:
    files, cache = corpus
    with pytest.warns(UserWarning, match=r"were longer than block_size=48 tokens and were truncated"):
        ds = TextFiles([str(f) for f in files], cache_dir=cache, packing=False, block_size=48)
    lengths = {len(ds[i]["input_ids"]) for i in range(len(ds))}
    assert max(lengths) == 48 and min(lengths) < 48
    batch = pad_collate([ds[i] for i in range(4)])
    assert (batch["labels"] == -100).any() and batch["attention_mask"].sum() == sum(
        len(ds[i]["input_ids"]) for i in range(4)
    )


def test_held_out_split_is_every_kth_sample_and_the_stream_matches(corpus: tuple[list[Path], str]) -> None:
    files, cache = corpus
    names = [str(f) for f in files]
    full = TextFiles(names, cache_dir=cache, block_size=32)
    train = TextFiles(names, cache_dir=cache, block_size=32, eval_fraction=0.1)
    held = train.held_out()
    assert held is not None and len(train) + len(held) == len(full) and len(held) == len(full) // 10
    assert torch.equal(held[0]["input_ids"], full[9]["input_ids"])
    assert torch.equal(train[9]["input_ids"], full[10]["input_ids"])
    stream = list(TextStream(names, cache_dir=cache, block_size=32, eval_fraction=0.1))
    assert len(stream) == len(train)
    assert all(torch.equal(s["input_ids"], train[i]["input_ids"]) for i, s in enumerate(stream))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        padded = TextFiles(names, cache_dir=cache, packing=False, block_size=40)
        padded_stream = list(TextStream(names, cache_dir=cache, packing=False, block_size=40))
    assert len(padded_stream) == len(padded)
    assert all(torch.equal(s["input_ids"], padded[i]["input_ids"]) for i, s in enumerate(padded_stream))


def test_jsonl_text_field(tmp_path: Path, corpus: tuple[list[Path], str]) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", field="text")
    text = TextFiles([str(corpus[0][0])], eval_files=[str(path)], cache_dir=corpus[1], block_size=32)
    held = text.held_out()  # .txt training files, JSONL eval files
    assert held is not None and bytes(held[0]["input_ids"].tolist()).startswith(
        paragraphs(1)[0][:32].encode()
    )
    path = write_jsonl(tmp_path / "r.jsonl", field="content")
    ds = TextFiles(
        [str(path)], text_field="content", cache_dir=str(tmp_path / "c"), packing=False, block_size=4096
    )
    assert bytes(ds[0]["input_ids"].tolist()).decode() == paragraphs(1)[0]
    with pytest.raises(
        ValueError, match=r"text_field=.text. is not a field of .*its records have content, id"
    ):
        TextFiles([str(path)], cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"text_field='text' is not a field of the first record"):
        TextStream([str(path)], cache_dir=str(tmp_path / "c"))


BAD_FILES = {
    "missing": (lambda d: [str(d / "nope.txt")], "does not exist"),
    "empty": (lambda d: [str(d / "empty.txt")], "is empty"),
    "no files": (lambda d: [], "names no file"),
    "mixed kinds": (lambda d: [str(d / "a.txt"), str(d / "r.jsonl")], "mixes JSONL and plain text"),
    "too little text": (lambda d: [str(d / "a.txt")], "less than one block of block_size=4096"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_value_errors_naming_the_fix(tmp_path: Path, case: str) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("a little text\n")
    write_jsonl(tmp_path / "r.jsonl", count=3, field="text")
    files, fragment = BAD_FILES[case]
    with pytest.raises(ValueError, match=fragment):
        TextFiles(files(tmp_path), cache_dir=str(tmp_path / "c"), block_size=4096)


def test_model_must_fit_the_data(corpus: tuple[list[Path], str]) -> None:
    files, cache = corpus
    ds = TextFiles([str(f) for f in files], cache_dir=cache, block_size=32)
    with pytest.raises(ValueError, match=r"vocabulary has 200 entries .* set model.vocab_size=256"):
        ds.check_model(tiny(vocab_size=200))
    wide = TextFiles([str(f) for f in files], cache_dir=cache, block_size=128)
    with pytest.raises(ValueError, match=r"block_size=128 is longer than the model's 64 positions"):
        probe(tiny(), wide, pad_collate, lambda m, b: token_cross_entropy(m, b, shift=True))


def test_model_loss_equals_our_summed_loss_and_its_mean_fails_the_probe(
    corpus: tuple[list[Path], str],
) -> None:
    files, cache = corpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = TextFiles([str(f) for f in files], cache_dir=cache, packing=False, block_size=48)
    model = tiny()
    batch = pad_collate([ds[i] for i in range(6)])
    ours, n = token_cross_entropy(model, batch, shift=True)
    theirs, m = model_loss(model, batch)
    assert int(n) == int(m) and float(theirs.detach()) == pytest.approx(float(ours.detach()), rel=1e-6)
    probe(model, ds, pad_collate, model_loss)  # the labels= path made a sum: accepted
    with pytest.raises(ValueError, match="does not return a sum.*That is a mean"):
        probe(model, ds, pad_collate, lambda mdl, b: model_loss(mdl, b, as_sum=False))


def test_stream_source_serves_the_plan_sources_micro_batches(corpus: tuple[list[Path], str]) -> None:
    files, cache = corpus
    names = [str(f) for f in files]
    mapped, stream = (
        TextFiles(names, cache_dir=cache, block_size=32),
        TextStream(names, cache_dir=cache, block_size=32),
    )
    global_batch = 24
    steps = len(mapped) // global_batch + 2  # into the second epoch, through the partial window
    for split, rank in ((Split(3, 4, 2), 1), (Split(2, 3, 4), 2), (Split(24, 1, 1), 0)):
        plan = GlobalBatchOrder(len(mapped), global_batch, seed=0, shuffle=False)
        a = OrderSource(mapped, pad_collate, plan, split, rank, steps)
        b = StreamSource(stream, pad_collate, split, rank)
        partial = 0
        for _ in range(steps):
            wa, wb = a.window(), b.window()
            partial += wa.partial
            assert (wa.step, wa.epoch, wa.samples, wa.partial) == (wb.step, wb.epoch, wb.samples, wb.partial)
            for ma, mb in zip(wa.micro, wb.micro, strict=True):
                assert ma.samples == mb.samples and torch.equal(ma.batch["input_ids"], mb.batch["input_ids"])
            a.advance()
            b.advance()
        assert partial == 1 and wa.epoch == 1  # the walk went through a partial window into epoch 1


def test_stream_windows_resume_at_the_exact_next_sample(corpus: tuple[list[Path], str]) -> None:
    files, cache = corpus
    stream = TextStream([str(f) for f in files], cache_dir=cache, block_size=32)
    total = sum(1 for _ in stream)
    straight = StreamWindows(stream, 10, drop_last=True)
    windows = [w for _, w in zip(range(2 * (total // 10) + 1), straight, strict=False)]
    assert [w.epoch for w in windows].count(0) == total // 10 and all(len(w.samples) == 10 for w in windows)
    source = StreamSource(stream, pad_collate, Split(5, 1, 2), 0, drop_last=True)
    for _ in range(total // 10 - 1):
        source.window()
        source.advance()
    state = source.state_dict()
    resumed = StreamSource(stream, pad_collate, Split(5, 1, 2), 0, drop_last=True)
    resumed.load_state_dict(state)
    for expected in windows[total // 10 - 1 : total // 10 + 2]:
        served = resumed.window()
        first = next(served.micro).batch["input_ids"]
        assert served.epoch == expected.epoch and torch.equal(first[0], expected.samples[0]["input_ids"])
        resumed.advance()
    with pytest.raises(ValueError, match="yields no window in epoch 0"):
        next(iter(StreamWindows(stream, total + 1, drop_last=True)))


def test_eval_shards_give_every_rank_the_same_number_of_forwards() -> None:
    for size, world, micro in ((10, 2, 3), (3, 4, 2), (7, 1, 7)):
        shards = [shard_batches(size, world, r, micro) for r in range(world)]
        assert len({len(s) for s in shards}) == 1
        assert sorted(int(i) for s in shards for piece in s for i in piece) == list(range(size))


def test_eval_needs_held_out_data_when_asked(corpus: tuple[list[Path], str]) -> None:
    files, cache = corpus
    ds = TextFiles([str(f) for f in files], cache_dir=cache, block_size=32)
    assert eval_dataset(EvalConfig(), ds, None) is None  # at_end only: no held-out data, no evaluation
    with pytest.raises(ValueError, match="there is no held-out data"):
        eval_dataset(EvalConfig(every=5), ds, None)
    tiny_eval = TextFiles([str(files[0])], cache_dir=cache, block_size=32, eval_fraction=0.001)
    with pytest.raises(ValueError, match="the eval split holds no samples"):
        eval_dataset(EvalConfig(), tiny_eval, None)


def test_evaluate_is_the_global_mean_whatever_the_micro_batch(
    corpus: tuple[list[Path], str], tmp_path: Path
) -> None:
    files, cache = corpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = TextFiles(
            [str(f) for f in files], cache_dir=cache, packing=False, block_size=48, eval_fraction=0.25
        )
    held = ds.held_out()
    assert held is not None
    model = tiny().double()
    loss = partial(token_cross_entropy, shift=True)
    with torch.no_grad():
        whole, items = loss(model, pad_collate([held[i] for i in range(len(held))]))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        results = [
            evaluate(model, held, pad_collate, loss, micro_batch=mb, device=torch.device("cpu"))
            for mb in (1, 4, len(held))
        ]
    finally:
        dist.destroy_process_group()
    for r in results:
        assert r.items == int(items) and r.samples == len(held)
        assert r.loss == pytest.approx(float(whole) / float(items), rel=1e-12)
        assert r.record(7)["eval_ppl"] == pytest.approx(torch.exp(torch.tensor(r.loss)).item())
    assert model.training  # back in training mode


def test_truncating_metrics_on_resume_keeps_the_evaluations(tmp_path: Path) -> None:
    import json

    lines = [
        {"step": 0, "eval_loss": 5.0},
        {"step": 1, "loss": 4.0},
        {"step": 2, "loss": 3.5},
        {"step": 2, "eval_loss": 3.4},
        {"step": 3, "loss": 3.0},
        {"step": 4, "eval_loss": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [r["step"] for r in truncate_metrics(tmp_path, 2)] == [1, 2]
    assert [r["step"] for r in read_evals(tmp_path)] == [0, 2]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_eval_dataset_node_is_instantiated_at_the_edge(corpus: tuple[list[Path], str]) -> None:
    from distaccum.config import from_mapping
    from distaccum.preflight import instantiate_components

    files, cache = corpus
    node = {
        "_target_": "distaccum.textdata.TextFiles",
        "files": [str(files[0])],
        "cache_dir": cache,
        "block_size": 32,
    }
    cfg = from_mapping(
        {
            "model": {"_target_": "distaccum.hf.causal_lm"},
            "loss": {"_target_": "distaccum.losses.token_cross_entropy", "_partial_": True, "shift": True},
            "data": {"dataset": {**node, "files": [str(f) for f in files]}},
            "eval": {"dataset": node, "every": 2},
        }
    )
    parts = instantiate_components(cfg)
    assert isinstance(parts.eval_dataset, TextFiles) and len(parts.eval_dataset) < len(parts.dataset)
    assert eval_dataset(cfg.eval, parts.dataset, parts.eval_dataset) is parts.eval_dataset


def test_an_unshifted_token_loss_on_text_files_is_refused_before_training(
    corpus: tuple[list[Path], str],
) -> None:
    """model=tiny_gpt data=text_files keeps tiny_gpt's token_ce (no shift): labels equal the inputs, so the model
    would learn to copy them. The probe refuses it naming loss=causal_ce; the shifted loss passes."""
    files, cache = corpus
    ds = TextFiles([str(f) for f in files], cache_dir=cache, block_size=32)
    with pytest.raises(ValueError, match="loss=causal_ce"):
        probe(tiny(), ds, pad_collate, partial(token_cross_entropy, ignore_index=-100))
    probe(tiny(), ds, pad_collate, partial(token_cross_entropy, ignore_index=-100, shift=True))
