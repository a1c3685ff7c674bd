# Ported from Colossal-AI examples/language/bert/data.py at commit
# 4f9953be335ef371b3848719ddafe596c01ecd37 by the import rule
# (colossalai -> pc_compat.colossalai). Changed beyond it, by original line:
# - 1-2 imports of datasets and AutoTokenizer: `import torch`.
# - 49 `max_seq_length: int = 128`: 16 (tiny).
# - 64 tokenizer from_pretrained: None (no download; the synthetic data needs none).
# - 68-77 `datasets.load_dataset("glue", ...)` and its tokenization: synthetic_glue() at the end
#   of this file (offline synthetic data: random ids, fixed seed).
# - 81-83 prepare_data and 109-124 convert_to_features: removed (they only read the download).
# Layout: ruff format and ruff's behaviour-preserving fixes (import order, List -> list,
# Optional[X] -> X | None, elif/else after return, str.format -> f-string).
# mypy: ignore-errors
# ruff: noqa: RUF012, RET503, SIM118
import torch

from pc_compat.colossalai.booster.plugin.dp_plugin_base import DPPluginBase


class GLUEDataBuilder:
    task_text_field_map = {
        "cola": ["sentence"],
        "sst2": ["sentence"],
        "mrpc": ["sentence1", "sentence2"],
        "qqp": ["question1", "question2"],
        "stsb": ["sentence1", "sentence2"],
        "mnli": ["premise", "hypothesis"],
        "qnli": ["question", "sentence"],
        "rte": ["sentence1", "sentence2"],
        "wnli": ["sentence1", "sentence2"],
        "ax": ["premise", "hypothesis"],
    }

    glue_task_num_labels = {
        "cola": 2,
        "sst2": 2,
        "mrpc": 2,
        "qqp": 2,
        "stsb": 1,
        "mnli": 3,
        "qnli": 2,
        "rte": 2,
        "wnli": 2,
        "ax": 3,
    }

    loader_columns = [
        "datasets_idx",
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "start_positions",
        "end_positions",
        "labels",
    ]

    def __init__(
        self,
        model_name_or_path: str,
        plugin: DPPluginBase,
        task_name: str = "mrpc",
        max_seq_length: int = 16,
        train_batch_size: int = 32,
        eval_batch_size: int = 32,
        **kwargs,
    ):
        super().__init__()
        self.model_name_or_path = model_name_or_path
        self.task_name = task_name
        self.max_seq_length = max_seq_length
        self.train_batch_size = train_batch_size
        self.eval_batch_size = eval_batch_size
        self.plugin = plugin

        self.text_fields = self.task_text_field_map[task_name]
        self.num_labels = self.glue_task_num_labels[task_name]
        self.tokenizer = None
        self.setup()

    def setup(self):
        self.dataset = synthetic_glue(self.num_labels, self.max_seq_length)

        self.eval_splits = [x for x in self.dataset.keys() if "validation" in x]

    def train_dataloader(self):
        return self.plugin.prepare_dataloader(
            self.dataset["train"], batch_size=self.train_batch_size, shuffle=True, drop_last=True
        )

    def val_dataloader(self):
        #   as the last batch may not be divisible by the number of microbatches
        if len(self.eval_splits) == 1:
            return self.plugin.prepare_dataloader(
                self.dataset["validation"], batch_size=self.eval_batch_size
            )
        if len(self.eval_splits) > 1:
            return [
                self.plugin.prepare_dataloader(self.dataset[x], batch_size=self.eval_batch_size)
                for x in self.eval_splits
            ]

    def test_dataloader(self):
        if len(self.eval_splits) == 1:
            return self.plugin.prepare_dataloader(
                self.dataset["test"], batch_size=self.eval_batch_size
            )
        if len(self.eval_splits) > 1:
            return [
                self.plugin.prepare_dataloader(self.dataset[x], batch_size=self.eval_batch_size)
                for x in self.eval_splits
            ]


VOCAB_SIZE = 64
SPLIT_SIZES = {"train": 128, "validation": 64, "test": 64}


def synthetic_glue(num_labels, max_seq_length):
    """Offline stand-in for the tokenized GLUE splits: random token ids, fixed seed."""
    g = torch.Generator().manual_seed(0)
    dataset = {}
    for split, n in SPLIT_SIZES.items():
        ids = torch.randint(1, VOCAB_SIZE, (n, max_seq_length), generator=g)
        labels = torch.randint(0, num_labels, (n,), generator=g)
        dataset[split] = [
            {
                "input_ids": ids[i],
                "token_type_ids": torch.zeros_like(ids[i]),
                "attention_mask": torch.ones_like(ids[i]),
                "labels": labels[i],
            }
            for i in range(n)
        ]
    return dataset
