"""Upload an HF model directory to the Hugging Face Hub, with a model card; the same as `hf3d push`.

    python conversion/push_to_hub.py DIR REPO_ID [--private] [--revision R] [--commit-message M]

The token comes from HF_TOKEN or `hf auth login`. See hf3d/hf/hub.py for what is uploaded and how
the card is made.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf3d without an install

from hf3d.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["push", *sys.argv[1:]]))
