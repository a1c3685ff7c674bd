# Ported from Colossal-AI examples/images/vit/data.py at commit
# 4f9953be335ef371b3848719ddafe596c01ecd37 by the import rule
# (colossalai -> pc_compat.colossalai). Changed beyond it, by original line:
# - 2 `from datasets import load_dataset`: removed.
# - 10-11 `load_dataset("beans")[split]` and its label names: synthetic_beans(split) at the end of
#   this file (3x16x16 random images, fixed seed) and beans' three label names.
# - 27 `self.image_processor(example["image"], ...)`: the image tensor as pixel_values.
# Layout: ruff format and ruff's behaviour-preserving fixes (import order, List -> list,
# Optional[X] -> X | None, elif/else after return, str.format -> f-string).
# mypy: ignore-errors
import torch
from torch.utils.data import Dataset


class BeansDataset(Dataset):
    def __init__(self, image_processor, tp_size=1, split="train"):
        super().__init__()
        self.image_processor = image_processor
        self.ds = synthetic_beans(split)
        self.label_names = ["angular_leaf_spot", "bean_rust", "healthy"]
        while len(self.label_names) % tp_size != 0:
            # ensure that the number of labels is multiple of tp_size
            self.label_names.append(f"pad_label_{len(self.label_names)}")
        self.num_labels = len(self.label_names)
        self.inputs = []
        for example in self.ds:
            self.inputs.append(self.process_example(example))

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, idx):
        return self.inputs[idx]

    def process_example(self, example):
        input = {"pixel_values": example["image"]}
        input["labels"] = example["labels"]
        return input


def beans_collator(batch):
    return {
        "pixel_values": torch.cat([data["pixel_values"] for data in batch], dim=0),
        "labels": torch.tensor([data["labels"] for data in batch], dtype=torch.int64),
    }


def synthetic_beans(split):
    """Offline stand-in for the beans split: 16x16 images as processed tensors, fixed seed."""
    g = torch.Generator().manual_seed({"train": 0, "validation": 1}[split])
    n = {"train": 32, "validation": 16}[split]
    images = torch.randn(n, 1, 3, 16, 16, generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return [{"image": images[i], "labels": int(labels[i])} for i in range(n)]
