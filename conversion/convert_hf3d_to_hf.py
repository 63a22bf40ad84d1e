"""hf3d checkpoint (any mesh) -> HF directory, on one CPU process; the same as `hf3d convert to-hf`.

    python conversion/convert_hf3d_to_hf.py CKPT OUT [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]

See hf3d/checkpoint/convert.py for what is read and written.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "to-hf", *sys.argv[1:]]))
