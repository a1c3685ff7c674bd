# Colossal-AI docs/source/en/features/gradient_clipping_with_booster.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: its code blocks of steps 1-5 (md
# lines 42-132) in order, by the import rule (colossalai -> pc_compat.colossalai).
# Other changes:
# - md lines 47-49 (torchvision imports): the offline stand-in's (synthetic
#   CIFAR-shaped tensors, identity transforms, a tiny transformers ResNet).
# - md lines 115-116 `.cuda()`: removed (CPU).
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
import os
from pathlib import Path

import torch
from offline_torchvision import CIFAR10, resnet34, transforms
from tqdm import tqdm  # noqa: F401  (as the doc imports it)

from pc_compat import colossalai
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import TorchDDPPlugin
from pc_compat.colossalai.logging import get_dist_logger
from pc_compat.colossalai.nn.lr_scheduler import CosineAnnealingLR

colossalai.launch_from_torch()
logger = get_dist_logger()

# define training hyperparameters
NUM_EPOCHS = 200
BATCH_SIZE = 128
GRADIENT_CLIPPING = 0.1
# build resnet
model = resnet34(num_classes=10)
# build dataloaders
train_dataset = CIFAR10(
    root=Path(os.environ.get("DATA", "./data")),
    download=True,
    transform=transforms.Compose(
        [
            transforms.RandomCrop(size=32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.4914, 0.4822, 0.4465], std=[0.2023, 0.1994, 0.2010]),
        ]
    ),
)
# build criterion
criterion = torch.nn.CrossEntropyLoss()

# optimizer
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

# lr_scheduler
lr_scheduler = CosineAnnealingLR(optimizer, total_steps=NUM_EPOCHS)

plugin = TorchDDPPlugin()
booster = Booster(mixed_precision="fp16", plugin=plugin)
train_dataloader = plugin.prepare_dataloader(
    train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
)
model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
    model, optimizer, criterion, train_dataloader, lr_scheduler
)

# verify gradient clipping
model.train()
for idx, (img, label) in enumerate(train_dataloader):
    model.zero_grad()
    output = model(img)
    train_loss = criterion(output, label)
    booster.backward(train_loss, optimizer)
    optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)
    optimizer.step()
    lr_scheduler.step()

    ele_1st = next(model.parameters()).flatten()[0]
    logger.info(f"iteration {idx}, loss: {train_loss}, 1st element of parameters: {ele_1st.item()}")

    # only run for 4 iterations
    if idx == 3:
        break
