"""HF model (directory or Hub id) -> weights-only hf3d checkpoint; the same as `hf3d convert from-hf`.

    python conversion/convert_hf_to_hf3d.py SRC OUT [--fsync]

`hf3d train` starts from the result with `--set model.path=OUT` (step 0, fresh optimizer), and
`hf3d.load_checkpoint` loads it; see hf3d/checkpoint/convert.py for the format.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "from-hf", *sys.argv[1:]]))
