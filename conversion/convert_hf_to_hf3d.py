"""HF model (directory or Hub id) -> weights-only hf3d checkpoint; the same as `hf3d convert from-hf`.

    python conversion/convert_hf_to_hf3d.py SRC OUT

`hf3d train` can start from the result (checkpoint.resume=OUT); see hf3d/convert.py for the format.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.convert import add_from_hf_arguments  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_from_hf_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
