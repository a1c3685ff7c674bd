# Colossal-AI docs/source/en/features/mixed_precision_training_with_booster.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: its code blocks of the hands-on
# practice (md lines 148-256) in order, by the import rule (colossalai ->
# pc_compat.colossalai); the fragments at md lines 76-102 are not part of it.
# Other changes:
# - md line 153 `from timm.models import vit_base_patch16_224` and md line 155
#   (torchvision imports): the offline stand-in's (a tiny transformers ViT
#   returning logits on 32x32 images; synthetic Caltech101-shaped tensors;
#   identity transforms). timm and torchvision are not installable here.
# - md line 154 `from titans.utils import barrier_context`: removed (titans is not
#   installable; the name is unused).
# - md lines 171-172 `parser = colossalai.get_default_parser()` and `args = ...`:
#   removed (doc error: Colossal-AI 0.5.0 has no get_default_parser; args is unused).
# - md line 191 `drop_rate=0.1`: 0.0 (tiny config: dropout would draw different
#   masks on the ranks and in the single-process reference).
# - md line 202 `Gray2RGB(),`: removed (doc error: never defined).
# - md line 237 `booster.boost(..., dataloader, ...)`: `train_dataloader` (doc error:
#   `dataloader` is never defined).
# - md line 247 `for img, label in enumerate(train_dataloader):`: without
#   enumerate (doc error: it would bind the batch index to img).
# - md lines 248-249 `.cuda()`: removed (CPU).
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
# ruff: noqa: B007
import os
from pathlib import Path

import torch
from offline_torchvision import datasets, transforms, vit_base_patch16_224

from pc_compat import colossalai
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import TorchDDPPlugin
from pc_compat.colossalai.logging import get_dist_logger  # noqa: F401  (as the doc imports it)
from pc_compat.colossalai.nn.lr_scheduler import LinearWarmupLR

# launch from torch
colossalai.launch_from_torch()

# define the constants
NUM_EPOCHS = 2
BATCH_SIZE = 128

# build model
model = vit_base_patch16_224(drop_rate=0.0)

# build dataloader
train_dataset = datasets.Caltech101(
    root=Path(os.environ["DATA"]),
    download=True,
    transform=transforms.Compose(
        [
            transforms.Resize(256),
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
        ]
    ),
)

# build optimizer
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)

# build loss
criterion = torch.nn.CrossEntropyLoss()

# lr_scheduler
lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=50, total_steps=NUM_EPOCHS)

plugin = TorchDDPPlugin()
train_dataloader = plugin.prepare_dataloader(
    train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
)
booster = Booster(mixed_precision="fp16", plugin=plugin)

# if you need to customize the config, do like this
# >>> from colossalai.mixed_precision import FP16TorchMixedPrecision
# >>> mixed_precision = FP16TorchMixedPrecision(
# >>>     init_scale=2.**16,
# >>>     growth_factor=2.0,
# >>>     backoff_factor=0.5,
# >>>     growth_interval=2000)
# >>> plugin = TorchDDPPlugin()
# >>> booster = Booster(mixed_precision=mixed_precision, plugin=plugin)

# boost model, optimizer, criterion, dataloader, lr_scheduler
model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
    model, optimizer, criterion, train_dataloader, lr_scheduler
)

model.train()
for epoch in range(NUM_EPOCHS):
    for img, label in train_dataloader:
        optimizer.zero_grad()
        output = model(img)
        loss = criterion(output, label)
        booster.backward(loss, optimizer)
        optimizer.step()
    lr_scheduler.step()
