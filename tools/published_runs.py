"""The planner on published large runs: for each, the layout pc's planner
ranks first on the hardware its authors used, beside the layout they
report, with the predicted memory per GPU of both (docs/planner.md).

Run: ``python tools/published_runs.py`` (a few seconds: the models are
built on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pc_train.cost import estimate, model_shape
from pc_train.hardware import gpu_device
from pc_train.models import ModelSpec
from pc_train.options import PluginKind, PluginOptions
from pc_train.planner import Cluster, search


@dataclass(frozen=True)
class Run:
    name: str
    family: str  # the transformers config class
    config: dict[str, Any]
    gpu: str
    nodes: int
    per_node: int
    inter_gbps: float  # GB/s per GPU between nodes
    seq_len: int
    global_batch: int  # sequences per step
    reported: PluginOptions | None  # the authors' layout, as pc's options
    source: str
    micro_batch: int = 1  # the authors' micro-batch


# Megatron-LM and Megatron-DeepSpeed recompute every block's activations
# (assumed for Llama 3 too, whose paper does not say).
_RECOMPUTED = "full"


def _megatron(tp: int, pp: int, zero: int) -> PluginOptions:
    """A tp x pp layout with ZeRO ``zero`` and full recomputation."""
    return PluginOptions(
        PluginKind.HYBRID, tp=tp, pp=pp, zero_stage=zero, activation_checkpointing=_RECOMPUTED
    )


_LLAMA3 = {"vocab_size": 128256, "num_key_value_heads": 8, "max_position_embeddings": 8192}
RUNS = [
    Run(
        "Llama 3 405B", "LlamaConfig",
        {**_LLAMA3, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
         "num_attention_heads": 128},
        "H100", 2048, 8, 50.0, 8192, 2048,
        _megatron(8, 16, 1),
        "Llama 3 paper, table 4: 16,384 H100, TP 8, PP 16, DP 128, 16 M tokens a step",
    ),
    Run(
        "Llama 3 70B", "LlamaConfig",
        {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
         "num_attention_heads": 64},
        "H100", 128, 8, 50.0, 8192, 2048, None,
        "Llama 3 paper: H100 clusters; layout and GPU count not reported (1,024 shown)",
    ),
    Run(
        "Llama 3 8B", "LlamaConfig",
        {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32},
        "H100", 32, 8, 50.0, 8192, 512, None,
        "Llama 3 paper: layout and GPU count not reported (256 shown)",
    ),
    Run(
        "GPT-3 175B", "GPT2Config",
        {"vocab_size": 50257, "n_positions": 2048, "n_embd": 12288, "n_layer": 96,
         "n_head": 96},
        "A100", 128, 8, 25.0, 2048, 1536,
        _megatron(8, 8, 0),
        "GPT-3's layout is not in its paper (V100s); Megatron-LM's run of the same model "
        "(Narayanan et al. 2021): 1,024 A100, TP 8, PP 8, batch 1,536",
    ),
    Run(
        "Bloom 176B", "BloomConfig",
        {"vocab_size": 250880, "hidden_size": 14336, "n_layer": 70, "n_head": 112},
        "A100", 48, 8, 25.0, 2048, 2048,
        _megatron(4, 12, 1),
        "BigScience: 384 A100 80GB, TP 4, PP 12, DP 8, ZeRO-1, batch 2,048",
        2,
    ),
    Run(
        "Megatron-Turing NLG 530B", "GPT2Config",
        {"vocab_size": 50257, "n_positions": 2048, "n_embd": 20480, "n_layer": 105,
         "n_head": 128},
        "A100", 280, 8, 25.0, 2048, 1920,
        _megatron(8, 35, 0),
        "Smith et al. 2022: 2,240 A100 80GB (280 DGX), TP 8, PP 35, DP 8, batch 1,920",
    ),
]  # fmt: skip


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def main() -> None:
    import transformers

    print(
        "| run | hardware | authors' layout | its predicted memory per GPU | pc's first plan | "
        "predicted memory per GPU | predicted tokens/s, pc / authors' |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in RUNS:
        config = getattr(transformers, run.family)(**run.config)
        shape = model_shape(ModelSpec(run.name, config))
        device = gpu_device(run.gpu, "bf16")
        cluster = Cluster(run.nodes, run.per_node, device, run.inter_gbps * 1e9)
        plans = search(shape, cluster, run.global_batch, run.seq_len, "bf16")
        best = plans[0] if plans else None
        theirs = ""
        ratio = ""
        if run.reported is not None:
            reported = run.reported
            # As reported, even where pc's own rules would refuse it (an
            # uneven pipeline split): estimated, not planned.
            dp = reported.dp_size(cluster.world)
            chunks = run.global_batch // dp // run.micro_batch
            reported = replace(reported, microbatches=chunks)
            mine = estimate(
                shape,
                reported,
                cluster.world,
                run.micro_batch,
                run.seq_len,
                "bf16",
                device,
                cluster.links,
            )
            theirs = _gib(mine.device_bytes) + ("" if mine.fits else " (over 90 %)")
            if best is not None:
                their_rate = mine.tokens_per_step / mine.step_seconds
                ratio = f"{best.tokens_per_second / their_rate:.2f}"
        plan = f"`{best.flags()}` (micro-batch {best.micro_batch})" if best else "none fits"
        memory = _gib(best.estimate.device_bytes) if best else ""
        hardware = f"{run.nodes * run.per_node:,} {run.gpu} ({run.nodes} x {run.per_node})"
        layout = run.source
        print(f"| {run.name} | {hardware} | {layout} | {theirs} | {plan} | {memory} | {ratio} |")


if __name__ == "__main__":
    main()
