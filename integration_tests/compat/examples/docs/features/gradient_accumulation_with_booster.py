# Colossal-AI docs/source/en/features/gradient_accumulation_with_booster.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: its code blocks of steps 1-5 (md
# lines 23-127) in order, by the import rule (colossalai -> pc_compat.colossalai);
# the GeminiPlugin fragment (md lines 153-169) is not part of it. Other changes:
# - md lines 28-30 (torchvision imports): the offline stand-in's (synthetic
#   CIFAR-shaped tensors, identity transforms, a tiny transformers ResNet).
# - md line 37 `from colossalai.cluster.dist_coordinator import priority_execution`
#   and md line 63 `with priority_execution():`: DistCoordinator().priority_execution()
#   (doc error: Colossal-AI 0.5.0 has no module-level priority_execution either).
# - md lines 45-46 `parser = colossalai.get_default_parser()` and `args = ...`:
#   removed (doc error: Colossal-AI 0.5.0 has no get_default_parser; args is unused).
# - md lines 99-100 `.cuda()`: removed (CPU).
# - added (assembly): `param_by_iter = []` (the block uses it undefined); md lines
#   121-125 dedented to the top level (the block indents them by 4).
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
import os
from pathlib import Path

import torch
from offline_torchvision import CIFAR10, resnet18, transforms
from torch.utils.data import DataLoader  # noqa: F401  (as the doc imports it)

from pc_compat import colossalai
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import TorchDDPPlugin
from pc_compat.colossalai.cluster import DistCoordinator
from pc_compat.colossalai.logging import get_dist_logger  # noqa: F401  (as the doc imports it)

# launch from torch
colossalai.launch_from_torch()

# define the training hyperparameters
BATCH_SIZE = 128
GRADIENT_ACCUMULATION = 4

# build resnet
model = resnet18(num_classes=10)

# build dataloaders
with DistCoordinator().priority_execution():
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

plugin = TorchDDPPlugin()
booster = Booster(plugin=plugin)
train_dataloader = plugin.prepare_dataloader(
    train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
)
model, optimizer, criterion, train_dataloader, _ = booster.boost(
    model=model, optimizer=optimizer, criterion=criterion, dataloader=train_dataloader
)

param_by_iter = []
optimizer.zero_grad()
for idx, (img, label) in enumerate(train_dataloader):
    sync_context = booster.no_sync(model)
    if idx % (GRADIENT_ACCUMULATION - 1) != 0:
        with sync_context:
            output = model(img)
            train_loss = criterion(output, label)
            train_loss = train_loss / GRADIENT_ACCUMULATION
            booster.backward(train_loss, optimizer)
    else:
        output = model(img)
        train_loss = criterion(output, label)
        train_loss = train_loss / GRADIENT_ACCUMULATION
        booster.backward(train_loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()

    ele_1st = next(model.parameters()).flatten()[0]
    param_by_iter.append(str(ele_1st.item()))

    if idx != 0 and idx % (GRADIENT_ACCUMULATION - 1) == 0:
        break

for iteration, val in enumerate(param_by_iter):
    print(f"iteration {iteration} - value: {val}")

if param_by_iter[-1] != param_by_iter[0]:
    print("The parameter is only updated in the last iteration")
