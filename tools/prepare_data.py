"""Write verl-format parquet (train.parquet, test.parquet) from GSM8K's or MATH's own files.

    python tools/prepare_data.py gsm8k --input ~/Downloads/grade-school-math/data --output data/gsm8k
    python tools/prepare_data.py math --input ~/Downloads/MATH --output data/math

Without --input, the hub is read through `datasets` where it is installed and online.
The rows and the input layouts are described in megarl/data/prepare.py and docs/data.md.
A bad input exits with status 2 and one line naming the file, row and field.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from megarl.data.prepare import RECIPES, prepare
from megarl.utils.errors import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prepare_data.py",
        description="Write verl-format train.parquet and test.parquet from GSM8K's or MATH's "
                    "own files.")
    parser.add_argument("dataset", choices=sorted(RECIPES))
    parser.add_argument("--input", action="append", default=[], metavar="PATH",
                        help="a downloaded file or directory of the dataset (repeatable); "
                             "none: read the hub through `datasets`")
    parser.add_argument("--output", required=True, metavar="DIR")
    args = parser.parse_args(argv)
    try:
        counts, skipped = prepare(args.dataset, args.input, args.output)
    except ConfigError as err:
        parser.exit(2, f"prepare_data.py: error: {err}\n")
    out = Path(args.output)
    # a CLI's summary: what a user reads when the tool returns
    for split, n in counts.items():
        print(f"{split}: {n} rows -> {out / f'{split}.parquet'}")
    if skipped:
        print(f"skipped {skipped} input file(s) that are not {args.dataset}'s train/test rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
