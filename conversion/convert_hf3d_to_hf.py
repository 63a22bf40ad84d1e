"""hf3d checkpoint (any mesh) -> HF directory, on one CPU process; the same as `hf3d convert to-hf`.

    python conversion/convert_hf3d_to_hf.py CKPT OUT [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]

See hf3d/convert.py for what is read and written.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.convert import add_to_hf_arguments  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_to_hf_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
