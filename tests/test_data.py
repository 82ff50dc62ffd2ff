"""Data: synthetic tasks, token files from text, deterministic sharding, clear errors (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch

from nsa_flex.training.data import DataError, ShardedBatches, SyntheticTask, TokenFile
from nsa_flex.model import IGNORE_INDEX
from nsa_flex.training import tokens
from nsa_flex.training.tokens import build_token_file, cached_token_file, load_tokenizer, open_source, stdlib_files


def test_kv_task_structure():
    task = SyntheticTask(task="kv", seq_len=128, seed=3)
    inputs, targets = task.sample(7)
    assert inputs.shape == targets.shape == (128,)
    assert int(inputs.max()) < task.vocab_size
    seq = torch.cat([inputs, targets[-1:]])
    pairs = {int(seq[1 + 2 * i]): int(seq[2 + 2 * i]) for i in range(task.n_pairs)}
    answered = (targets != IGNORE_INDEX).nonzero().flatten()
    assert len(answered) > 0
    for t in answered.tolist():
        # The target after a query key is that key's value, given far earlier in the sequence.
        assert int(targets[t]) == pairs[int(inputs[t])]
    torch.testing.assert_close(task.sample(7), (inputs, targets))
    assert not torch.equal(task.sample(8)[0], inputs)


def test_copy_task_structure():
    task = SyntheticTask(task="copy", seq_len=64, seed=0)
    inputs, targets = task.sample(0)
    seq = torch.cat([inputs, targets[-1:]])
    m = 63 // 2
    assert torch.equal(seq[1:1 + m], seq[2 + m:2 + 2 * m])
    # Only the copy (and the separator) can be predicted.
    assert (targets != IGNORE_INDEX).sum() == m + 1


def test_synthetic_errors():
    with pytest.raises(DataError, match="unknown synthetic task 'sort'"):
        SyntheticTask(task="sort")
    with pytest.raises(DataError, match="seq_len >= 8"):
        SyntheticTask(seq_len=4)


def test_sharding_is_deterministic_and_disjoint():
    task = SyntheticTask(task="kv", seq_len=32)
    whole = ShardedBatches(task, batch_size=4)
    ranks = [ShardedBatches(task, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, y = whole.next()
        parts = [b.next() for b in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
    assert whole.position == ranks[0].position == ranks[1].position == 12
    resumed = ShardedBatches(task, batch_size=4)
    resumed.load_state_dict(whole.state_dict())
    assert torch.equal(resumed.next()[0], whole.next()[0])


def test_prefetch_changes_neither_the_batches_nor_the_position():
    """prefetch() samples the next micro-batch early: the same batches in the same order, the
    position (what checkpoints save) moved only by next(); a resume drops a batch sampled ahead."""
    task = SyntheticTask(task="kv", seq_len=32)
    plain, ahead = ShardedBatches(task, batch_size=2, rank=1, world_size=2), \
        ShardedBatches(task, batch_size=2, rank=1, world_size=2)
    for _ in range(3):
        ahead.prefetch()
        ahead.prefetch()  # twice: still one batch ahead, not two
        assert ahead.position == plain.position
        assert all(torch.equal(a, b) for a, b in zip(ahead.next(), plain.next()))
    ahead.prefetch()
    state = ahead.state_dict()
    assert state["position"] == 12
    ahead.load_state_dict({**state, "position": 4})  # back to an earlier checkpoint
    rewound = ShardedBatches(task, batch_size=2, rank=1, world_size=2, position=4)
    assert all(torch.equal(a, b) for a, b in zip(ahead.next(), rewound.next()))


TEXT = " ".join(str(i) for i in range(60))


def _write_corpus(folder):
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    rows = [json.dumps({"text": "ünïcode text"}), "", json.dumps({"text": "more"})]
    (folder / "b.jsonl").write_text("\n".join(rows) + "\n")
    (folder / "skip.csv").write_text("ignored")
    return folder


def test_token_file_from_text_folder(tmp_path):
    folder = _write_corpus(tmp_path / "corpus")
    out = build_token_file(str(folder), load_tokenizer("byte"), tmp_path / "tok.bin")
    meta = json.loads((tmp_path / "tok.bin.json").read_text())
    n_bytes = len(TEXT.encode()) + len("ünïcode text".encode()) + len(b"more")
    assert meta["n_tokens"] == n_bytes + 3 and meta["n_documents"] == 3 and meta["vocab_size"] == 257
    source = TokenFile(out, seq_len=16, seed=1)
    x, y = source.sample(0)
    assert torch.equal(x[1:], y[:-1])
    seen = {tuple(source.sample(i)[0].tolist()) for i in range(source.n_windows)}
    # One epoch visits every window once, in a seeded order.
    assert len(seen) == source.n_windows
    assert torch.equal(TokenFile(out, seq_len=16, seed=1).sample(5)[0], source.sample(5)[0])


def test_open_source_caches_text_and_tracks_changes(tmp_path):
    folder = _write_corpus(tmp_path / "corpus")
    kw = dict(seq_len=16, seed=0, tokenizer="byte", cache_dir=tmp_path / "cache")
    source = open_source(str(folder), **kw)
    assert isinstance(source, TokenFile)
    first = cached_token_file(str(folder), "byte", tmp_path / "cache", "text")
    (folder / "a.txt").write_text("changed " * 50)
    os.utime(folder / "a.txt", ns=(1, 10**18))
    assert cached_token_file(str(folder), "byte", tmp_path / "cache", "text") != first
    assert isinstance(open_source("kv", **kw), SyntheticTask)
    assert isinstance(open_source(str(source.path), **kw), TokenFile)


def test_token_file_errors(tmp_path):
    folder = _write_corpus(tmp_path / "corpus")
    out = build_token_file(str(folder), load_tokenizer("byte"), tmp_path / "tok.bin")
    with pytest.raises(DataError, match="needs at least 10001"):
        TokenFile(out, seq_len=10_000)
    with open(out, "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match="truncated or stale"):
        TokenFile(out, seq_len=16)
    os.remove(f"{out}.json")
    with pytest.raises(DataError, match="has no sidecar"):
        TokenFile(out, seq_len=16)


@pytest.mark.parametrize("data, match", [
    pytest.param("no/such/dir", "not a synthetic task .* no such file or folder", id="missing"),
    pytest.param("hf:no/such/dataset", "no saved Hugging Face dataset", id="hf-missing"),
])
def test_bad_data_paths(tmp_path, data, match):
    with pytest.raises(DataError, match=match):
        open_source(data, seq_len=16, seed=0, tokenizer="byte", cache_dir=tmp_path)


def test_bad_text_files(tmp_path):
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        open_source(str(tmp_path / "x.csv"), seq_len=16, seed=0, tokenizer="byte", cache_dir=tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: expected an object with a string field 'text'"):
        open_source(str(tmp_path / "bad.jsonl"), seq_len=16, seed=0, tokenizer="byte", cache_dir=tmp_path / "c")


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_is_a_clear_error(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="parquet needs pyarrow"):
        open_source(str(tmp_path / "t.parquet"), seq_len=16, seed=0, tokenizer="byte", cache_dir=tmp_path / "c")


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_tokenizer_file_without_tokenizers_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="needs the `tokenizers` package"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_dataset_without_datasets_is_a_clear_error(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    with pytest.raises(DataError, match="needs the `datasets` package"):
        open_source(f"hf:{tmp_path / 'ds'}", seq_len=16, seed=0, tokenizer="byte", cache_dir=tmp_path / "c")


def test_stdlib_files_are_the_standard_library_in_a_fixed_order():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and "os.py" in rel and "json/decoder.py" in rel
    assert not [r for r in rel if r.split("/")[0] in ("site-packages", "dist-packages", "test")]
    assert all(p.suffix == ".py" for p in files)


def test_stdlib_source_end_to_end(tmp_path, monkeypatch):
    """--data stdlib: byte tokens of the sources in path order, each file one document."""
    lib = tmp_path / "lib"
    for rel, text in {"b.py": "def b():\n    return 2\n", "a/x.py": "import os\n", "site-packages/p.py": "x = 1\n",
                      "test/t.py": "assert 1\n", "a/notes.txt": "not python\n"}.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    monkeypatch.setattr(tokens.sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    source = open_source("stdlib", seq_len=8, seed=0, tokenizer="byte", cache_dir=tmp_path / "cache")
    want = list(b"import os\n") + [256] + list(b"def b():\n    return 2\n") + [256]
    assert source.tokens.tolist() == want and source.vocab_size == 257
    inputs, targets = source.sample(0)
    assert inputs.shape == (8,) and torch.equal(inputs[1:], targets[:-1])
