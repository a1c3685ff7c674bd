# Colossal-AI docs/source/en/features/lazy_init.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: its code block (md lines 24-46), by
# the import rule (colossalai -> pc_compat.colossalai). Other changes:
# - md line 32 `colossalai.launch()`: launch_from_torch() (doc error: launch takes
#   rank, world_size, host and port, in Colossal-AI 0.5.0 too; the doc's test
#   command runs the block under torchrun).
# - md line 34 `booster = Booster(plugin)`: Booster(plugin=plugin) (doc error: the
#   first parameter of Booster is `device`; Colossal-AI 0.5.0 stops there with
#   "AssertionError: Device <...GeminiPlugin object...> is not supported yet").
# - md line 38 `default_device="cuda"`: "cpu".
# - md line 44 `BertForPreTraining.from_pretrained("prajjwal1/bert-tiny")`:
#   BertForPreTraining(BertConfig(...)) with bert-tiny's sizes (no download).
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
from transformers import BertConfig, BertForPreTraining, LlamaConfig, LlamaForCausalLM

from pc_compat import colossalai
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import GeminiPlugin
from pc_compat.colossalai.lazy import LazyInitContext

colossalai.launch_from_torch()
plugin = GeminiPlugin()
booster = Booster(plugin=plugin)

# 1. Initialize model from scratch
# Initialization on cuda will accelerate the initialization process but take more GPU memory.
with LazyInitContext(default_device="cpu"):
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4
        )
    )
model, *_ = booster.boost(model)

# 2. Initialize model from pretrained
with LazyInitContext():
    model = BertForPreTraining(
        BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512
        )
    )
model, *_ = booster.boost(model)
