"""Write docs/config_reference.md from the config schema (or, with --check, fail if stale).

    python tools/gen_config_reference.py [--check]
"""
import argparse
import os
import sys
from pathlib import Path

from megarl.config.reference import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    a = ap.parse_args()
    text = render()
    if a.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python tools/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    tmp = DOC.with_name(f".{DOC.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
