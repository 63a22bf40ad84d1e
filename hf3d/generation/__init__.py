"""Generation at the training mesh: KV-cached decoding of a ParallelModel over its tp / pp / dp / cp / ep ranks
(hf3d/generation/decode.py)."""
