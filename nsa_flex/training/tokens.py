"""Text into memory-mapped token files, and the one place a `data` setting becomes a source.

A data setting is one of: a synthetic task name ("kv", "copy"); "stdlib", the .py sources of
the running Python's standard library (offline text that every install has); a token file
(`*.bin` with its `*.bin.json` sidecar); a local file or folder of .txt / .md / .jsonl /
.parquet text; or `hf:<folder>`, a Hugging Face dataset saved with `save_to_disk`. Text is tokenised once
(byte-level, or with a local `tokenizer.json` of the `tokenizers` library) into a token
file under the run's cache folder, keyed by the sources' names, sizes and times and the
tokenizer; documents are separated by the tokenizer's end-of-text token.
Optional libraries (pyarrow, tokenizers, datasets) are imported only when needed, and
their absence is a clear error, never a silent fallback.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator

from nsa_flex.training.data import SYNTHETIC_TASKS, TOKEN_FILE_FORMAT, DataError, SyntheticTask, TokenFile

TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
STDLIB = "stdlib"
"""The data setting for the standard library's sources."""
# Not the standard library's own code: installed packages, and CPython's regression tests (half
# of the rest, and unlike the library code they test).
_STDLIB_SKIP = ("site-packages", "dist-packages", "test")
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes 0..255, end-of-text 256."""

    name = "byte"
    vocab_size = 257
    eos = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class FileTokenizer:
    """A local `tokenizer.json` of the Hugging Face `tokenizers` library."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise DataError(f"--tokenizer {path} needs the `tokenizers` package (pip install tokenizers), "
                            "or use --tokenizer byte") from e
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist")
        self._tok = Tokenizer.from_file(str(path))
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos = next((self._tok.token_to_id(n) for n in EOS_NAMES if self._tok.token_to_id(n) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: str):
    """"byte" or the path of a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else FileTokenizer(Path(spec))


def open_source(data: str, *, seq_len: int, seed: int, tokenizer: str, cache_dir: Path,
                text_key: str = "text", build: bool = True):
    """The TokenSource of a data setting (module docstring). With build=False a text source
    must already be tokenised (other ranks wait for rank 0 to build it)."""
    if data in SYNTHETIC_TASKS:
        return SyntheticTask(task=data, seq_len=seq_len, seed=seed)
    if data.endswith(".bin") and Path(data).is_file():
        return TokenFile(data, seq_len=seq_len, seed=seed)
    path = cached_token_file(data, tokenizer, cache_dir, text_key)
    if build and not path.exists():
        build_token_file(data, load_tokenizer(tokenizer), path, text_key=text_key)
    return TokenFile(path, seq_len=seq_len, seed=seed)


def text_files(data: str) -> list[Path]:
    """The text files of a file or folder setting (or of "stdlib"), sorted; a clear error if there are none."""
    if data == STDLIB:
        return stdlib_files()
    path = Path(data)
    if not path.exists():
        raise DataError(f"--data {data!r}: not a synthetic task ({', '.join(SYNTHETIC_TASKS)}), not {STDLIB!r}, "
                        "and no such file or folder")
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise DataError(f"--data {data}: unsupported file type {path.suffix!r}; "
                            f"allowed: {', '.join(TEXT_SUFFIXES)} or a .bin token file with its .json")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"--data {data}: the folder holds no {', '.join(TEXT_SUFFIXES)} files")
    return files


def stdlib_files() -> list[Path]:
    """The standard library's .py files (sysconfig's "stdlib" path), by relative path: the same
    order on every run of one Python install."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if p.is_file() and p.relative_to(root).parts[0] not in _STDLIB_SKIP]
    if not files:
        raise DataError(f"--data {STDLIB}: no .py files under {root} (sysconfig's stdlib path)")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def cached_token_file(data: str, tokenizer: str, cache_dir: Path, text_key: str) -> Path:
    """Where the tokens of `data` live: a name that changes when any source file changes."""
    h = hashlib.sha256(f"{tokenizer}|{text_key}|{_tokenizer_stamp(tokenizer)}".encode())
    if data.startswith("hf:"):
        sources = [Path(data[3:])]
        if not sources[0].exists():
            raise DataError(f"--data {data}: no saved Hugging Face dataset at {sources[0]}")
        sources += sorted(p for p in sources[0].rglob("*") if p.is_file())
    else:
        sources = text_files(data)
    for p in sources:
        st = p.stat()
        h.update(f"|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return Path(cache_dir) / f"tokens-{h.hexdigest()[:16]}.bin"


def build_token_file(data: str, tok, out_path: Path, *, text_key: str = "text") -> Path:
    """Tokenise every document of `data` into `out_path` (+ `.json`), written atomically."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    dtype, typecode = ("uint16", "H") if tok.vocab_size <= 2**16 else ("uint32", "I")
    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    n_tokens = n_docs = 0
    with open(tmp, "wb") as f:
        for text in iter_documents(data, text_key):
            ids = tok.encode(text) + ([] if tok.eos is None else [tok.eos])
            array.array(typecode, ids).tofile(f)
            n_tokens, n_docs = n_tokens + len(ids), n_docs + 1
    meta = {"format": TOKEN_FILE_FORMAT, "dtype": dtype, "n_tokens": n_tokens, "n_documents": n_docs,
            "vocab_size": tok.vocab_size, "eos": tok.eos, "tokenizer": tok.name, "source": data}
    meta_tmp = Path(f"{tmp}.json")
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(meta_tmp, f"{out_path}.json")
    os.replace(tmp, out_path)
    return out_path


def iter_documents(data: str, text_key: str = "text") -> Iterator[str]:
    """Documents of a text setting: a whole .txt/.md file, a jsonl line, a parquet or dataset row."""
    if data.startswith("hf:"):
        yield from _hf_documents(Path(data[3:]), text_key)
        return
    for path in text_files(data):
        if path.suffix in (".txt", ".md", ".py"):
            yield path.read_text(encoding="utf-8", errors="replace")
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path, text_key)
        else:
            yield from _parquet_documents(path, text_key)


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise DataError(f"{path}:{line_no}: expected an object with a string field {text_key!r}")
            yield row[text_key]


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    table = pq.read_table(path)
    if text_key not in table.column_names:
        raise DataError(f"{path}: no column {text_key!r}; columns: {', '.join(table.column_names)}")
    yield from (t for t in table.column(text_key).to_pylist() if t)


def _hf_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"hf:{path} needs the `datasets` package (pip install datasets)") from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"hf:{path}: no 'train' split; splits: {', '.join(ds)}")
        ds = ds["train"]
    if text_key not in ds.column_names:
        raise DataError(f"hf:{path}: no column {text_key!r}; columns: {', '.join(ds.column_names)}")
    yield from (row[text_key] for row in ds)


def _tokenizer_stamp(tokenizer: str) -> str:
    if tokenizer == "byte":
        return "byte"
    p = Path(tokenizer)
    return f"{p.stat().st_size}:{p.stat().st_mtime_ns}" if p.is_file() else "missing"
