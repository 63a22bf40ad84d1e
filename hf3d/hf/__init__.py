"""The Hugging Face side of hf3d: HF folders read by slices and written as transformers writes them, the collective
export of a ParallelModel (`save_pretrained`), and the Hub push with its model card."""
