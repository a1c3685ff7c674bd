"""Adam's moments in fp32, bf16 and 8 bits: the loss over 300 steps.

A GPT-2 (4 layers, width 128, 4 heads, byte vocabulary, 0.9 M parameters)
and a Llama of the same size, trained from the same initial weights on the
same batches (8 x 128 bytes of the Python standard library's sources) with
pc_offload.CPUAdamW (lr 1e-3, weight decay 0.01) storing its moments as
``state_dtype`` fp32, bf16 and int8. Printed: the mean loss of the last 20
steps of each, and the largest gap to fp32 of the 20-step running mean.

    python benchmarks/optimizer_states_loss.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import transformers
from torch import nn

from pc_offload import CPUAdamW

SEQ, BATCH, WINDOW = 128, 8, 20


def _corpus() -> torch.Tensor:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config: transformers.PretrainedConfig = transformers.GPT2Config(
            vocab_size=256, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model: nn.Module = transformers.GPT2LMHeadModel(config)
        return model
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return model


def train(family: str, state_dtype: str, steps: int, corpus: torch.Tensor) -> list[float]:
    model = _model(family)
    optimizer = CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, state_dtype=state_dtype)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - SEQ, (BATCH,), generator=generator)
        ids = torch.stack([corpus[s : s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _running(values: list[float]) -> list[float]:
    return [sum(values[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(values) + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args, _ = parser.parse_known_args()
    torch.set_num_threads(2)
    corpus = _corpus()
    for family in ("gpt2", "llama"):
        runs = {
            dtype: train(family, dtype, args.steps, corpus) for dtype in ("fp32", "bf16", "int8")
        }
        base = _running(runs["fp32"])
        for dtype, losses in runs.items():
            mean = _running(losses)
            gap = max(abs(a - b) for a, b in zip(mean, base, strict=True))
            print(
                f"{family:6s} {dtype:5s} first {losses[0]:.3f}  last-{WINDOW} mean {mean[-1]:.4f}  "
                f"largest gap to fp32 (running mean) {gap:.4f}"
            )


if __name__ == "__main__":
    main()
