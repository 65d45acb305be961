#!/usr/bin/env python3
"""Build a megatron-core indexed dataset (PREFIX.bin + PREFIX.idx) from a folder of text files.

Byte-level tokenization (ids 0..255 = bytes, 256 = EOD, vocab 384): every file is one
document followed by EOD. Files are taken in sorted relative-path order, so the same
folder always gives the same dataset.

    python scripts/prepare_data.py --input my_texts/ --output-prefix data/my_text_document
    python scripts/prepare_data.py --stdlib            # the embedded default, cached in data_cache/

Train on it with ``scripts/pretrain_gpt.py --data-path data/my_text_document``.
"""

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a clone without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from megatron_ext.training import data as gpt_data  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", type=pathlib.Path, help="folder of text files (searched recursively)")
    src.add_argument("--stdlib", action="store_true",
                     help="build the embedded default (Python stdlib *.py) under data_cache/")
    parser.add_argument("--pattern", action="append", default=None,
                        help="glob for files under --input (repeatable; default: *.txt, *.md, *.py)")
    parser.add_argument("--output-prefix", help="output PREFIX (writes PREFIX.bin and PREFIX.idx)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = parser.parse_args(argv)

    if args.stdlib:
        prefix = gpt_data.default_dataset_prefix(REPO_ROOT / "data_cache",
                                                 progress=not args.no_progress)
    else:
        if not args.output_prefix:
            parser.error("--output-prefix is required with --input")
        if not args.input.is_dir():
            parser.error(f"--input {str(args.input)!r} is not a folder")
        files = gpt_data.collect_files(args.input, args.pattern or ["*.txt", "*.md", "*.py"])
        if not files:
            parser.error(f"no files matching {args.pattern or ['*.txt', '*.md', '*.py']} "
                         f"under {str(args.input)!r}")
        prefix = gpt_data.strip_prefix(args.output_prefix)
        gpt_data.write_indexed_dataset(files, prefix, progress=not args.no_progress)
    docs, tokens = gpt_data.validate_indexed_dataset(prefix)
    print(f"dataset {prefix}.bin/.idx: {docs} documents, {tokens} tokens "
          f"(vocab {gpt_data.PADDED_VOCAB_SIZE}, eod {gpt_data.EOD})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
