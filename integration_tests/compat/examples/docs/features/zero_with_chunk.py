# Colossal-AI docs/source/en/features/zero_with_chunk.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: the blocks of the GPT example that
# form a program (md lines 108-206: model, loss, data, main), by the import rule
# (colossalai -> pc_compat.colossalai). The fragments at md lines 62-95 (the
# older GeminiDDP / GeminiAdamOptimizer API) are not part of it. Other changes:
# - added (assembly): the imports of torch, nn, transformers and colossalai the
#   blocks use without importing, and the `main()` call at the end.
# - md lines 120-126: GPT2Config(...) gets resid/embd/attn_pdrop=0.0 (tiny
#   config: dropout would draw different masks on the ranks and in the
#   single-process reference).
# - md line 134 `gpt2_medium`: hidden 32, 2 layers, 2 heads, 32 positions,
#   vocabulary 64 (tiny config).
# - md line 157 `device=torch.cuda.current_device()`: "cpu".
# - md line 172 `args = parse_args()`: removed (doc error: never defined; args unused).
# - md lines 174-176: SEQ_LEN 16, VOCAB_SIZE 64 (tiny config), NUM_STEPS 4 (fewer steps).
# - md line 181 `optimizer = HybridAdam(model.parameters(), ...)`: moved after the
#   model is built (doc error: `model` is used before it is assigned).
# - md line 185 `ColoInitContext(default_device=torch.device('cuda'))`:
#   LazyInitContext(default_device=torch.device("cpu")) (doc error: the block
#   imports LazyInitContext and never imports ColoInitContext).
# - md lines 194 and 205 `torch.cuda.synchronize()`: removed (CPU).
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
# ruff: noqa: N806, B007
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from pc_compat import colossalai
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import GeminiPlugin
from pc_compat.colossalai.lazy import LazyInitContext
from pc_compat.colossalai.nn.optimizer import HybridAdam


class GPTLMModel(nn.Module):
    def __init__(
        self,
        hidden_size=768,
        num_layers=12,
        num_attention_heads=12,
        max_seq_len=1024,
        vocab_size=50257,
        checkpoint=False,
    ):
        super().__init__()
        self.checkpoint = checkpoint
        self.model = GPT2LMHeadModel(
            GPT2Config(
                n_embd=hidden_size,
                n_layer=num_layers,
                n_head=num_attention_heads,
                n_positions=max_seq_len,
                n_ctx=max_seq_len,
                vocab_size=vocab_size,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids, attention_mask):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=not self.checkpoint
        )[0]


def gpt2_medium(checkpoint=False):
    return GPTLMModel(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        max_seq_len=32,
        vocab_size=64,
        checkpoint=checkpoint,
    )


class GPTLMLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def get_data(batch_size, seq_len, vocab_size):
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), device="cpu")
    attention_mask = torch.ones_like(input_ids)
    return input_ids, attention_mask


def main():
    BATCH_SIZE = 8
    SEQ_LEN = 16
    VOCAB_SIZE = 64
    NUM_STEPS = 4
    colossalai.launch_from_torch()

    # build criterion
    criterion = GPTLMLoss()

    torch.manual_seed(123)
    # build GPT model
    with LazyInitContext(default_device=torch.device("cpu")):
        model = gpt2_medium(checkpoint=True)
    optimizer = HybridAdam(model.parameters(), lr=0.001)

    # Gemini + ZeRO DP
    plugin = GeminiPlugin(max_norm=1.0, initial_scale=2**5)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)

    model.train()
    for n in range(NUM_STEPS):
        # we just use randomly generated data here
        input_ids, attn_mask = get_data(BATCH_SIZE, SEQ_LEN, VOCAB_SIZE)
        optimizer.zero_grad()
        outputs = model(input_ids, attn_mask)
        loss = criterion(outputs, input_ids)
        booster.backward(loss, optimizer)
        optimizer.step()


main()
