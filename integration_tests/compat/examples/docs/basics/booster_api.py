# Colossal-AI docs/source/en/basics/booster_api.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: its one code block (md lines 47-88),
# by the import rule (colossalai -> pc_compat.colossalai). Other changes:
# - md line 50 `from torchvision.models import resnet18`: the offline stand-in's
#   (a tiny transformers ResNet returning logits; torchvision is not installable).
# - md line 73 `x = x.to('cuda')`: 'cpu'.
# - added (assembly): `rank`, `world_size`, `port` from torchrun's environment
#   (the block uses them undefined; Colossal-AI's doc test passes them), and the
#   `train()` call at the end.
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
# ruff: noqa: E731
import os

import torch
from offline_torchvision import resnet18
from torch.optim import SGD

from pc_compat import colossalai
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import TorchDDPPlugin

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
port = int(os.environ["MASTER_PORT"])


def train():
    # launch colossalai
    colossalai.launch(rank=rank, world_size=world_size, port=port, host="localhost")

    # create plugin and objects for training
    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    model = resnet18()
    criterion = lambda x: x.mean()
    optimizer = SGD((model.parameters()), lr=0.001)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)

    # use booster.boost to wrap the training objects
    model, optimizer, criterion, _, scheduler = booster.boost(
        model, optimizer, criterion, lr_scheduler=scheduler
    )

    # do training as normal, except that the backward should be called by booster
    x = torch.randn(4, 3, 224, 224)
    x = x.to("cpu")
    output = model(x)
    loss = criterion(output)
    booster.backward(loss, optimizer)
    optimizer.clip_grad_by_norm(1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()

    # checkpointing using booster api
    save_path = "./model"
    booster.save_model(model, save_path, shard=True, size_per_shard=10, use_safetensors=True)

    new_model = resnet18()
    booster.load_model(new_model, save_path)


train()
