"""Data for the pretrain script: byte tokenizer, indexed datasets, megatron-core's GPTDataset.

* ``ByteTokenizer``: 256 byte ids + one EOD id, vocabulary padded to a multiple of 128.
* ``parse_data_path``: megatron's ``--data-path`` syntax (``PREFIX ...`` or ``W1 P1 W2 P2 ...``).
* ``validate_indexed_dataset``: checks a megatron-core ``.bin``/``.idx`` pair without
  megatron (existence, header, sizes) and raises ``DataPathError`` with a clear message.
* ``write_indexed_dataset`` / ``default_dataset_prefix``: build such a pair atomically
  (temp files, fsync, rename), the embedded default from the Python stdlib sources.
* ``build_gpt_dataset``: megatron-core's ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``,
  with ``create_attention_mask=False`` (no S x S mask is ever materialized).

Importing this module does not import torch or megatron; the functions that need them
import lazily, so the argument checks of pretrain_gpt.py stay fast. Nothing here knows
where the repository is: callers pass the cache folder (the entry scripts use the
repository's ``data_cache/``).
"""

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import os
import pathlib
import struct
import subprocess
import sys
import sysconfig
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple

# megatron-core warns at import time that it falls back to torch without TE/Apex
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

NUM_BYTES = 256
EOD = NUM_BYTES  # 256: the end-of-document id, right after the 256 byte ids
VOCAB_MULTIPLE = 128
PADDED_VOCAB_SIZE = -(-(NUM_BYTES + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # 384


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, 256 is EOD; vocab padded to 384.

    Has what megatron-core's GPT datasets read from a tokenizer (the interface of
    ``MegatronTokenizerBase``, duck-typed so that importing this module stays free of
    torch/megatron): ``vocab_size``, ``eod`` and ``unique_identifiers`` (part of the
    dataset cache hash). No pad id: megatron then pads short samples with its own
    sentinel and masks their loss.
    """

    def __init__(self):
        self.path = None
        self.unique_identifiers = {
            "class": "ByteTokenizer", "vocab_size": PADDED_VOCAB_SIZE, "eod": EOD}

    def tokenize(self, text) -> List[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(data)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES).decode("utf-8", "replace")

    @property
    def vocab(self):
        return {bytes([i]): i for i in range(NUM_BYTES)} | {"<eod>": EOD}

    @property
    def vocab_size(self) -> int:
        return PADDED_VOCAB_SIZE

    @property
    def eod(self) -> int:
        return EOD

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer has no chat template")


# --------------------------------------------------------------------------------------
# The indexed dataset format (megatron.core.datasets.indexed_dataset), checked without megatron
# --------------------------------------------------------------------------------------

_INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron's DType codes -> item size in bytes
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 4, 7: 8, 8: 2}
_FIXED_HEADER_LEN = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


class DataPathError(RuntimeError):
    """--data-path is missing, incomplete or not a megatron indexed dataset."""


def strip_prefix(path: str) -> str:
    """Accept 'prefix', 'prefix.bin' or 'prefix.idx'."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _as_weight(item: str) -> Optional[float]:
    try:
        return float(item)
    except ValueError:
        return None


def parse_data_path(items: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """megatron's ``--data-path``: ``P1 [P2 ...]`` or ``W1 P1 W2 P2 ...``; returns (prefixes, weights).

    Like megatron's ``get_blend_from_list``, a first item that parses as a number means
    the weighted form; unlike it, every malformed list gets an error that says what is
    wrong (a weight without a prefix, a prefix where a weight belongs, a mix of forms)
    instead of reporting a weight as a missing dataset. Pure: touches no file.
    """
    items = [str(x) for x in items]
    shown = " ".join(items)
    if not items:
        raise DataPathError("--data-path needs at least one dataset PREFIX")
    if _as_weight(items[0]) is None:
        numbers = [x for x in items if _as_weight(x) is not None]
        if numbers:
            raise DataPathError(
                f"--data-path {shown}: mixes plain prefixes with what look like weights "
                f"({', '.join(numbers)}); give either 'PREFIX1 PREFIX2 ...' or the blended form "
                f"'W1 PREFIX1 W2 PREFIX2 ...' (a weight before every prefix)")
        return items, None
    if len(items) % 2:
        raise DataPathError(
            f"--data-path {shown}: the blended form is 'W1 PREFIX1 W2 PREFIX2 ...' (pairs), but "
            f"{len(items)} entries were given: the weight {items[-1]} has no prefix after it")
    weights, prefixes = [], []
    for i in range(0, len(items), 2):
        weight, prefix = _as_weight(items[i]), items[i + 1]
        if weight is None:
            raise DataPathError(
                f"--data-path {shown}: entry {i + 1} ({items[i]!r}) should be the weight of "
                f"{prefix!r} in 'W1 PREFIX1 W2 PREFIX2 ...'")
        if _as_weight(prefix) is not None:
            raise DataPathError(
                f"--data-path {shown}: entry {i + 2} ({prefix!r}) should be a dataset prefix "
                f"after the weight {items[i]}, not another number")
        if not (weight > 0 and weight != float("inf")):
            raise DataPathError(
                f"--data-path {shown}: weight {items[i]} of {prefix!r} must be a positive "
                f"finite number")
        weights.append(weight)
        prefixes.append(prefix)
    return prefixes, weights


def validate_indexed_dataset(prefix: str) -> Tuple[int, int]:
    """Check ``prefix.bin``/``prefix.idx``; return (documents, tokens) or raise DataPathError."""
    prefix = strip_prefix(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
    if missing:
        raise DataPathError(
            f"--data-path {prefix!r}: missing {', '.join(missing)} (expected a megatron indexed "
            f"dataset: PREFIX.bin + PREFIX.idx; build one with scripts/prepare_data.py)")
    idx_size = os.path.getsize(idx_path)
    bin_size = os.path.getsize(bin_path)

    def bad(why: str) -> DataPathError:
        return DataPathError(f"--data-path {prefix!r}: corrupt index {idx_path}: {why}")

    with open(idx_path, "rb") as f:
        head = f.read(_FIXED_HEADER_LEN)
        if len(head) < _FIXED_HEADER_LEN:
            raise bad(f"only {idx_size} bytes, shorter than the {_FIXED_HEADER_LEN}-byte header")
        if head[:9] != _INDEX_HEADER:
            raise bad(f"bad magic {head[:9]!r} (expected {_INDEX_HEADER!r})")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise bad(f"unsupported version {version}")
        code = head[17]
        if code not in _DTYPE_SIZES:
            raise bad(f"unknown dtype code {code}")
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        expected = _FIXED_HEADER_LEN + n_seq * (4 + 8) + n_doc * 8
        if idx_size not in (expected, expected + n_seq):  # + n_seq: multimodal modes
            raise bad(f"{idx_size} bytes, but its header ({n_seq} sequences, {n_doc} document "
                      f"boundaries) needs {expected}")
        if n_seq == 0 or n_doc < 2:
            raise bad("the dataset holds no documents")
        import numpy as np
        lengths = np.frombuffer(f.read(4 * n_seq), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * n_seq), dtype=np.int64)
        docs = np.frombuffer(f.read(8 * n_doc), dtype=np.int64)
    item = _DTYPE_SIZES[code]
    if (lengths < 0).any() or docs[0] != 0 or docs[-1] != n_seq or (np.diff(docs) < 0).any():
        raise bad("inconsistent sequence lengths / document boundaries")
    need = int(pointers[-1]) + int(lengths[-1]) * item
    if bin_size != need:
        raise DataPathError(
            f"--data-path {prefix!r}: {bin_path} has {bin_size} bytes but its index describes "
            f"{need} (truncated or from a different build)")
    return n_doc - 1, int(lengths.sum())


# --------------------------------------------------------------------------------------
# Writing datasets
# --------------------------------------------------------------------------------------

def fsync_path(path: str) -> None:
    """fsync a file or folder (a rename is durable once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dtype_for_vocab(vocab_size: int):
    import numpy as np
    return np.uint16 if vocab_size <= 65535 else np.int32


def write_indexed_dataset(files: Sequence[pathlib.Path], prefix: str,
                          progress: bool = True, desc: str = "tokenize") -> Tuple[int, int]:
    """Tokenize each file as one document (bytes + EOD) into ``prefix.bin``/``.idx``.

    Written to temp names, fsynced, then renamed (.bin first, .idx last), so a reader
    never sees a half-written pair that validates. Returns (documents, tokens).
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    prefix = strip_prefix(str(prefix))
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    dtype = _dtype_for_vocab(PADDED_VOCAB_SIZE)
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    docs = tokens = 0
    try:
        for path in tqdm(files, desc=desc, unit="file", disable=not progress,
                         mininterval=1.0, file=sys.stderr):
            data = pathlib.Path(path).read_bytes()
            if not data:
                continue
            arr = np.empty(len(data) + 1, dtype=dtype)
            arr[:-1] = np.frombuffer(data, dtype=np.uint8)
            arr[-1] = EOD
            builder.add_document(arr, [arr.size])
            docs += 1
            tokens += arr.size
        if docs == 0:
            raise DataPathError(f"no non-empty input files for {prefix!r}")
        builder.data_file.flush()
        os.fsync(builder.data_file.fileno())
        builder.finalize(tmp + ".idx")
        with open(tmp + ".idx", "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
        fsync_path(os.path.dirname(os.path.abspath(prefix)))
    finally:
        builder.data_file.close()  # a no-op after finalize(); closes it on an error path
        for suffix in (".bin", ".idx"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + suffix)
    return docs, tokens


def collect_files(root: pathlib.Path, patterns: Iterable[str],
                  exclude_parts: Iterable[str] = ()) -> List[pathlib.Path]:
    """Files under ``root`` matching any pattern, in a deterministic (sorted relative path) order."""
    root = pathlib.Path(root)
    exclude = set(exclude_parts)
    found = set()
    for pattern in patterns:
        for p in root.rglob(pattern):
            rel = p.relative_to(root)
            if p.is_file() and not (exclude & set(rel.parts)):
                found.add(rel.as_posix())
    return [root / rel for rel in sorted(found)]


STDLIB_EXCLUDE = ("site-packages", "dist-packages", "__pycache__")


def stdlib_files() -> List[pathlib.Path]:
    return collect_files(pathlib.Path(sysconfig.get_paths()["stdlib"]), ["*.py"], STDLIB_EXCLUDE)


def default_dataset_prefix(cache_dir: pathlib.Path, progress: bool = True) -> str:
    """The embedded default: the Python stdlib's own *.py files, built once under data_cache/.

    Safe when several processes (ranks) call it at once: a file lock serializes the build,
    and the pair appears atomically.
    """
    cache_dir = pathlib.Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    manifest = "\n".join(f"{p}:{p.stat().st_size}" for p in files)
    tag = hashlib.sha1(manifest.encode()).hexdigest()[:10]
    version = "".join(map(str, sys.version_info[:2]))
    prefix = str(cache_dir / f"stdlib-py{version}-{tag}_text_document")
    with open(cache_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            validate_indexed_dataset(prefix)
        except DataPathError:
            write_indexed_dataset(files, prefix, progress=progress, desc="building stdlib dataset")
            validate_indexed_dataset(prefix)
    return prefix


# --------------------------------------------------------------------------------------
# megatron-core's GPT dataset
# --------------------------------------------------------------------------------------

def ensure_megatron_helpers(cache_dir: pathlib.Path) -> None:
    """megatron-core's dataset index builder needs its C++ ``helpers_cpp`` extension.

    The megatron-core wheels ship it prebuilt (checked: 0.16.1, cp311 manylinux), so
    normally this only imports it. A source install without it gets it compiled once
    from the shipped ``helpers.cpp`` into ``cache_dir`` (the wheel has no Makefile for
    megatron's own ``compile_helpers()``); that needs a C++ compiler and pybind11.
    """
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError as exc:
        error = exc
    try:
        path = _compile_helpers(pathlib.Path(cache_dir))
        spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["megatron.core.datasets.helpers_cpp"] = module
    except (ImportError, OSError, subprocess.CalledProcessError) as exc:  # no pybind11 / compiler
        detail = getattr(exc, "stderr", None) or exc
        raise RuntimeError(
            "megatron-core's compiled dataset helpers (megatron/core/datasets/helpers_cpp) are "
            f"missing ({error}) and compiling them failed ({detail}); install a megatron-core wheel, "
            "or a C++ compiler and `pip install pybind11`") from exc


def _compile_helpers(cache_dir: pathlib.Path) -> str:
    import megatron.core.datasets as mcd
    import pybind11

    src = pathlib.Path(mcd.__file__).parent / "helpers.cpp"
    out_dir = cache_dir / "megatron_helpers"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    with open(out_dir / ".lock", "w") as lock:  # one compile, however many ranks ask
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            tmp = out.with_suffix(f".tmp{os.getpid()}")
            cxx = os.environ.get("CXX", "c++")
            subprocess.run([cxx, "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC",
                            f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                            str(src), "-o", str(tmp)], check=True, capture_output=True, text=True)
            os.replace(tmp, out)
    return str(out)


def build_gpt_dataset(prefixes: Sequence[str], tokenizer: ByteTokenizer, seq_length: int,
                      num_samples: int, seed: int, cache_path: str,
                      weights: Optional[Sequence[float]] = None):
    """The training split of megatron-core's GPT dataset over indexed dataset prefix(es).

    One prefix gives a GPTDataset, several a BlendedDataset (weights None: by size).

    Must be called on every rank (after the process group exists, rank 0 builds the
    sample index cache first, the others then read it).
    """
    ensure_megatron_helpers(pathlib.Path(cache_path))
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([strip_prefix(p) for p in prefixes], list(weights) if weights else None),
        split="100,0,0",
        path_to_cache=cache_path,
        tokenizer=tokenizer,
        # Documents are packed; attention is block-diagonal per document (our CP engine
        # finds documents from the EOD tokens), positions restart at each document, and
        # no S x S attention mask is ever built.
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    return train
