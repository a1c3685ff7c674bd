# Ported from Colossal-AI examples/language/opt/data.py at commit
# 4f9953be335ef371b3848719ddafe596c01ecd37 by the import rule
# (colossalai -> pc_compat.colossalai). Changed beyond it, by original line:
# - 2 `from datasets import load_dataset`: removed.
# - 6-30 NetflixDataset: 32 samples of 16 random token ids, fixed seed (offline synthetic data;
#   the constructor keeps its tokenizer parameter).
# Layout: ruff format and ruff's behaviour-preserving fixes (import order, List -> list,
# Optional[X] -> X | None, elif/else after return, str.format -> f-string).
# mypy: ignore-errors
import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 64
NUM_SAMPLES = 32
MAX_LENGTH = 16


class NetflixDataset(Dataset):
    """Offline stand-in for the tokenized netflix-shows descriptions: random token ids."""

    def __init__(self, tokenizer):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.input_ids = list(torch.randint(2, VOCAB_SIZE, (NUM_SAMPLES, MAX_LENGTH), generator=g))
        self.attn_masks = [torch.ones(MAX_LENGTH, dtype=torch.int64) for _ in range(NUM_SAMPLES)]

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, idx):
        return self.input_ids[idx], self.attn_masks[idx]


def netflix_collator(data):
    return {
        "input_ids": torch.stack([x[0] for x in data]),
        "attention_mask": torch.stack([x[1] for x in data]),
        "labels": torch.stack([x[0] for x in data]),
    }
