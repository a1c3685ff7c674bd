"""Colossal-AI's HybridParallelPlugin arguments, as its programs pass them:
each accepted one does what it says (checked so that ignoring it fails),
training still matches single-process training, and each refused one says
why and what pc does instead."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from pc_booster import HybridParallelPlugin
from pc_booster.plugin import Plugin
from pc_booster.plugins.optimizations import FusedRMSNorm
from pc_booster.rules import TrainPrecision
from pc_comm.testing import run_subtests
from pc_compat.colossalai.booster import Booster
from pc_compat.colossalai.booster.plugin import HybridParallelPlugin as EdgeHybrid

pytestmark = pytest.mark.timeout(300)


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _ids(step: int, size: int = 4) -> torch.Tensor:
    return torch.randint(0, 96, (size, 8), generator=torch.Generator().manual_seed(200 + step))


def _reference(build: Any, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        ids = _ids(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, model.state_dict()


def _train(plugin: Plugin, build: Any, steps: int) -> tuple[list[float], Any, Any]:
    booster = Booster(plugin=plugin)
    built = build()
    model, optimizer, *_ = booster.boost(
        built, torch.optim.SGD(built.parameters(), lr=0.1, momentum=0.9)
    )
    losses = []
    for step in range(steps):
        ids = _ids(step)
        if plugin.pp_size > 1:
            out = booster.execute_pipeline(
                iter([{"input_ids": ids, "labels": ids}]), model, None, optimizer
            )
            loss = out["loss"]
        else:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, booster, model


def _matches(build: Any, losses: list[float], booster: Booster, model: Any) -> None:
    want_losses, want_state = _reference(build, len(losses))
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    state = booster.plugin.model_state_dict(model.module)
    for key, value in want_state.items():
        if key in state:
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5)


def _norms_fused(model: Any) -> None:
    """Each of the model's RMS norms replaced by pc's fused one."""
    modules = list(model.unwrap().modules())
    assert not [m for m in modules if type(m).__name__ == "LlamaRMSNorm"]
    assert [m for m in modules if isinstance(m, FusedRMSNorm)]


def check_accepted(case: str) -> None:
    if case == "microbatch_size":
        plugin = HybridParallelPlugin(pp_size=2, zero_stage=1, microbatch_size=1)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.module.chunks == 4  # 4 rows, micro-batches of 1
        _matches(_gpt2, losses, booster, model)
    elif case == "num_model_chunks":
        plugin = HybridParallelPlugin(pp_size=2, pp_style="interleaved", num_model_chunks=2,
                                      zero_stage=1, num_microbatches=2)  # fmt: skip
        assert plugin.stage_manager is not None
        assert plugin.stage_manager.is_interleave
        losses, booster, model = _train(plugin, _llama_four_layers, 3)
        _matches(_llama_four_layers, losses, booster, model)
    elif case == "split_gather":
        plugin = HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True,
                                      sequence_parallelism_mode="split_gather")  # fmt: skip
        losses, booster, model = _train(plugin, _gpt2, 3)
        _matches(_gpt2, losses, booster, model)
    elif case == "flash_attention":
        plugin = HybridParallelPlugin(tp_size=2, enable_flash_attention=True)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.unwrap().config._attn_implementation == "sdpa"
        _matches(_gpt2, losses, booster, model)
    elif case == "fused_normalization":
        plugin = HybridParallelPlugin(tp_size=2, enable_fused_normalization=True)
        losses, booster, model = _train(plugin, _llama, 3)
        _norms_fused(model)
        _matches(_llama, losses, booster, model)
    elif case == "all_optimization":  # Colossal-AI's flag, at the edge
        plugin = EdgeHybrid(tp_size=2, pp_size=1, enable_all_optimization=True, precision="fp32")
        losses, booster, model = _train(plugin, _llama, 2)
        assert model.unwrap().config._attn_implementation == "sdpa"
        _norms_fused(model)
        _matches(_llama, losses, booster, model)
    elif case == "parallel_output":
        for parallel, width in ((True, 48), (False, 96)):
            booster = Booster(plugin=HybridParallelPlugin(tp_size=2, parallel_output=parallel))
            model, *_ = booster.boost(_gpt2())
            ids = _ids(0)
            out = model(input_ids=ids, labels=ids)
            assert out.logits.shape[-1] == width, (parallel, out.logits.shape)
    elif case == "execute_pipeline":  # Colossal-AI's criterion(outputs, inputs) and result
        plugin = HybridParallelPlugin(pp_size=2, zero_stage=1, num_microbatches=2)
        booster = Booster(plugin=plugin)
        built = _gpt2()
        model, optimizer, *_ = booster.boost(
            built, torch.optim.SGD(built.parameters(), lr=0.1, momentum=0.9)
        )
        seen: list[set[str]] = []

        def criterion(outputs: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append(set(inputs))
            loss: torch.Tensor = outputs[0]  # a transformers output computed with labels
            same = loss is outputs.loss
            assert same
            return loss

        losses = []
        for step in range(3):
            ids = _ids(step)
            batch = {"input_ids": ids, "labels": ids}
            out = booster.execute_pipeline(
                iter([batch]), model, criterion, optimizer, return_loss=True, return_outputs=True
            )
            assert set(out) == {"loss", "outputs"}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(out["loss"]))
        if plugin.stage_manager is not None and plugin.stage_manager.is_last_stage():
            assert seen == [{"input_ids", "labels"}] * 6, seen
        _matches(_gpt2, losses, booster, model)
    elif case == "overlap_communication":
        plugin = HybridParallelPlugin(tp_size=2, zero_stage=1, overlap_communication=False)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert booster.plugin.boosted(model.module).optimizer.overlap_communication is False
        _matches(_gpt2, losses, booster, model)
    dist.barrier()


def _llama_four_layers() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class _Unused(torch.nn.Module):
    """A model with a parameter its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x).square().mean()
        return out


def check_hybrid_data_parallel(case: str) -> None:
    if case == "zero":  # ZeRO's buckets and host offload
        sizes = []
        for size in (12.0, 1e-4):
            plugin = HybridParallelPlugin(tp_size=2, zero_stage=1, cpu_offload=True,
                                          zero_bucket_size_in_m=size)  # fmt: skip
            booster = Booster(plugin=plugin)
            built = _gpt2()
            _, optimizer, *_ = booster.boost(built, torch.optim.AdamW(built.parameters()))
            assert type(optimizer.unwrap()).__name__ == "CPUAdamW"  # the host optimizer
            sizes.append(len(optimizer.buckets))
        assert sizes[1] > sizes[0], sizes  # ~100-element buckets: many more
    elif case == "ddp":  # zero_stage=0: pc-comm DDP's own options
        counts = []
        for cap in (25.0, 1e-4):
            plugin = HybridParallelPlugin(ddp_bucket_cap_mb=cap, gradient_as_bucket_view=True)
            booster = Booster(plugin=plugin)
            model, *_ = booster.boost(_gpt2())
            counts.append(len(model.module.reducer.buckets))
        assert counts[1] > counts[0], counts
        booster = Booster(plugin=HybridParallelPlugin(find_unused_parameters=True))
        built = _Unused()
        model, optimizer, *_ = booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
        booster.backward(model(torch.randn(2, 4)), optimizer)  # no error: the unused is found
        optimizer.step()
        booster = Booster(plugin=HybridParallelPlugin())
        built = _Unused()
        model, optimizer, *_ = booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
        with pytest.raises(RuntimeError):  # pc-comm DDP names the parameter that got no gradient
            booster.backward(model(torch.randn(2, 4)), optimizer)
    elif case == "refused":
        refused: tuple[tuple[dict[str, Any], str], ...] = (
            ({"cpu_offload": True}, "set zero_stage=1 or 2"),
            ({"zero_stage": 1, "find_unused_parameters": True}, "used with zero_stage=0"),
            ({"zero_bucket_size_in_m": 1.0}, "used with zero_stage 1 or 2"),
        )
        for kwargs, message in refused:
            with pytest.raises(ValueError, match=message):
                HybridParallelPlugin(**kwargs)
        at_edge: tuple[tuple[dict[str, Any], str], ...] = (
            ({"communication_dtype": torch.float16}, "pc reduces gradients in fp32"),
            ({"static_graph": True}, "are torch DDP's"),
            ({"dp_outside": False}, "tensor-parallel innermost"),
            ({"use_fp8": True}, "there is no fp8 path"),
            ({"inner_ring_size": 2}, "pc runs ring attention over one ring"),
            ({"scheduler_nodes": object()}, "pc builds each schedule itself"),
        )  # Colossal-AI's arguments, at the edge
        for kwargs, message in at_edge:
            with pytest.raises(ValueError, match=message):
                EdgeHybrid(tp_size=1, pp_size=1, **kwargs)
        EdgeHybrid(tp_size=1, pp_size=1, make_vocab_size_divisible_by=128)  # no effect
    dist.barrier()


def test_hybrid_data_parallel_arguments() -> None:
    run_subtests(check_hybrid_data_parallel, 2, {"case": ["zero", "ddp", "refused"]},
                 timeout=200)  # fmt: skip


CASES = [
    "execute_pipeline",
    "microbatch_size",
    "num_model_chunks",
    "split_gather",
    "flash_attention",
    "fused_normalization",
    "all_optimization",
    "parallel_output",
    "overlap_communication",
]


def test_hybrid_arguments_do_what_they_say() -> None:
    run_subtests(check_accepted, 2, {"case": CASES}, timeout=280)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "both microbatch counts": (
        {"pp_size": 2, "num_microbatches": 2, "microbatch_size": 1},
        "both say how a batch splits; give one of them",
    ),
    "chunks without interleaving": (
        {"pp_size": 2, "num_model_chunks": 2},
        "pass pp_style='interleaved' with num_model_chunks=2",
    ),
    "ulysses without sp_size": (
        {
            "tp_size": 2,
            "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": "all_to_all",
        },
        "it splits the sequence over sp_size ranks of its own; pass sp_size >= 2",
    ),
    "ring": (
        {"tp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring"},
        "pc has 'split_gather'",
    ),
    "sp_size": ({"tp_size": 2, "sp_size": 2}, "leave sp_size out"),
    "gathered pipeline logits": (
        {"pp_size": 2, "parallel_output": False},
        "gather them there with pc_tensor.gather_logits",
    ),
}


# Colossal-AI's arguments pc's plugin does not take, refused at the edge.
EDGE_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "fp8": ({"fp8_communication": True}, "there is no fp8 path"),
    "jit": ({"enable_jit_fused": True}, "torch.compile fuses the same element-wise ops"),
    "policy": ({"custom_policy": object()}, "register one there and leave custom_policy out"),
}


def check_refused() -> None:
    for kwargs, message in REFUSED.values():
        with pytest.raises(ValueError, match=message):
            HybridParallelPlugin(**kwargs)
    for kwargs, message in EDGE_REFUSED.values():
        with pytest.raises(ValueError, match=message):
            EdgeHybrid(tp_size=1, pp_size=1, **kwargs)
    # gradient_checkpoint_config: pc's recomputation of that share of the blocks
    from pc_compat.colossalai.shardformer import (
        GradientCheckpointConfig,
        PipelineGradientCheckpointConfig,
    )

    half = EdgeHybrid(
        tp_size=1, pp_size=1, gradient_checkpoint_config=GradientCheckpointConfig(0.5)
    )
    assert half.options.activation_checkpointing == "full"
    assert half.options.activation_checkpointing_fraction == 0.5
    staged = PipelineGradientCheckpointConfig(
        num_stages=2, num_model_layers=4, num_ckpt_layers_per_stage=[1, 2]
    )
    quarter = EdgeHybrid(tp_size=1, pp_size=1, gradient_checkpoint_config=staged)
    assert quarter.options.activation_checkpointing_fraction == 0.75
    assert EdgeHybrid(tp_size=1, pp_size=1).options.activation_checkpointing == "none"
    # Colossal-AI's 'ring' (Megatron's with ring communication) is split_gather's values
    ring = EdgeHybrid(tp_size=2, pp_size=1, enable_sequence_parallelism=True,
                      sequence_parallelism_mode="ring")  # fmt: skip
    assert ring.options.sequence_parallelism_mode == "split_gather"
    plugin = HybridParallelPlugin(pp_size=2, zero_stage=1, microbatch_size=3)
    booster = Booster(plugin=plugin)
    built = _gpt2()
    model, optimizer, *_ = booster.boost(built, torch.optim.AdamW(built.parameters()))
    ids = _ids(0)
    with pytest.raises(ValueError, match="do not split into micro-batches of microbatch_size=3"):
        booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), model, None, optimizer)
    dist.barrier()


def test_hybrid_refusals() -> None:
    run_subtests(check_refused, 2, {}, timeout=120)


# -- TorchDDPPlugin under Booster(mixed_precision=...): torch's AMP -----------------------


def check_torch_ddp_amp() -> None:
    from pc_booster import TorchDDPPlugin

    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        booster = Booster(plugin=TorchDDPPlugin(initial_scale=2.0**8, hysteresis=1),
                          mixed_precision=precision)  # fmt: skip
        built = _gpt2()
        model, optimizer, *_ = booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 parameters
        ids = _ids(0, 2)
        out = model(input_ids=ids, labels=ids)
        assert out.logits.dtype == dtype, out.logits.dtype  # the forward ran under autocast
        booster.backward(out.loss, optimizer)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        moved = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        assert moved
        if precision == "fp16":  # an overflowing step is skipped and the scale backs off
            scaler = optimizer.policy.amp.scaler
            assert scaler.scale == 2.0**8
            booster.backward(model(input_ids=ids, labels=ids).loss * float("inf"), optimizer)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer.step()
            assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
            assert scaler.scale == 2.0**7
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")
    with pytest.raises(ValueError, match="no fp32 values to keep"):
        booster.boost(_gpt2().to(torch.bfloat16))
    with pytest.raises(ValueError, match="check_reduction=True: torch's DistributedDataParallel"):
        TorchDDPPlugin(check_reduction=True)
    from pc_compat.colossalai.booster.plugin import TorchDDPPlugin as EdgeTorchDDP

    with pytest.raises(ValueError, match="fp8_communication=True"):
        EdgeTorchDDP(fp8_communication=True)  # Colossal-AI's argument, at the edge
    dist.barrier()


def test_torch_ddp_mixed_precision_is_amp() -> None:
    run_subtests(check_torch_ddp_amp, 2, {}, timeout=120)


# -- TorchFSDPPlugin with FSDP1's arguments -------------------------------------------------


def check_fsdp1_arguments(case: str) -> None:
    import functools

    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FSDPModule,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )
    from torch.distributed.tensor import DTensor
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from pc_booster import TorchFSDPPlugin

    if case == "sharding_strategy":
        for strategy, resharded in ((ShardingStrategy.FULL_SHARD, True),
                                    (ShardingStrategy.SHARD_GRAD_OP, False)):  # fmt: skip
            booster = Booster(plugin=TorchFSDPPlugin(sharding_strategy=strategy))
            model, *_ = booster.boost(_gpt2())
            ids = _ids(0, 2)
            model(input_ids=ids, labels=ids)
            block = model.unwrap().transformer.h[0]
            assert isinstance(block.attn.c_attn.weight, DTensor) == resharded, strategy
    elif case == "auto_wrap_policy":
        by_class = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}
        )
        plugin = TorchFSDPPlugin(auto_wrap_policy=by_class)
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert all(isinstance(b, FSDPModule) for b in model.unwrap().transformer.h)
        _matches(_gpt2, losses, booster, model)
        nothing = functools.partial(size_based_auto_wrap_policy, min_num_params=10**9)
        booster = Booster(plugin=TorchFSDPPlugin(auto_wrap_policy=nothing))
        model, *_ = booster.boost(_gpt2())
        assert not any(isinstance(b, FSDPModule) for b in model.unwrap().transformer.h)
    elif case == "mixed_precision":
        plugin = TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        booster = Booster(plugin=plugin)
        model, *_ = booster.boost(_gpt2())
        ids = _ids(0, 2)
        assert model(input_ids=ids, labels=ids).logits.dtype == torch.bfloat16
    elif case == "cpu_offload_and_prefetch":
        plugin = TorchFSDPPlugin(cpu_offload=CPUOffload(offload_params=True),
                                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                                 sync_module_states=True)  # fmt: skip
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert all(p.device.type == "cpu" for p in model.parameters())
        _matches(_gpt2, losses, booster, model)
    elif case == "refused":
        for kwargs, message in (
            ({"sharding_strategy": ShardingStrategy.NO_SHARD}, "use TorchDDPPlugin to replicate"),
            ({"backward_prefetch": BackwardPrefetch.BACKWARD_POST}, "BACKWARD_POST is not offered"),
            ({"param_init_fn": lambda m: None}, "drop param_init_fn"),
            ({"ignored_modules": [torch.nn.Linear(1, 1)]}, "Freeze it"),
        ):
            with pytest.raises(ValueError, match=message):
                TorchFSDPPlugin(**kwargs)
        # fp16 trains (a loss scale over the shards), as Colossal-AI's does
        fp16 = TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=torch.float16))
        assert fp16.precision is TrainPrecision.FP16
    dist.barrier()


def test_torch_fsdp_takes_fsdp1_arguments() -> None:
    cases = ["sharding_strategy", "auto_wrap_policy", "mixed_precision",
             "cpu_offload_and_prefetch", "refused"]  # fmt: skip
    run_subtests(check_fsdp1_arguments, 2, {"case": cases}, timeout=200)


# -- LowLevelZeroPlugin's other arguments ---------------------------------------------------


def check_low_level_zero_arguments() -> None:
    import contextlib
    import io

    from pc_booster import LowLevelZeroPlugin
    from pc_compat.colossalai.booster.plugin import LowLevelZeroPlugin as EdgeLowLevelZero

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, verbose=True))
        built = _gpt2()
        booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
    said = printed.getvalue()
    if dist.get_rank() == 0:
        assert "LowLevelZeroPlugin ZeRO-2 over 2 ranks" in said, said
    else:
        assert said == ""
    for kwargs, message in (
        ({"norm_type": 1.0}, "pc clips by the global 2-norm"),
        ({"master_weights": False}, "pc keeps fp32 masters"),
        ({"communication_dtype": torch.bfloat16}, "reduces gradients in the dtype they are"),
        ({"fp8_communication": True}, "pc has no fp8 path"),
        ({"extra_dp_size": 3}, "extra_dp_size=3 must divide the 2 ranks"),
    ):  # Colossal-AI's arguments, at the edge (fp16 by default)
        with pytest.raises(ValueError, match=message):
            EdgeLowLevelZero(**kwargs)
    EdgeLowLevelZero(communication_dtype=torch.float16)  # the compute dtype: accepted
    EdgeLowLevelZero(precision="fp32", master_weights=False)  # fp32: no masters to drop
    dist.barrier()


def test_low_level_zero_arguments() -> None:
    run_subtests(check_low_level_zero_arguments, 2, {}, timeout=120)


# -- GeminiPlugin's other arguments ----------------------------------------------------------


def check_gemini_arguments(case: str) -> None:
    import contextlib
    import io

    # Colossal-AI's GeminiPlugin at the compatibility edge: fp16 by default,
    # so the fp32 parity cases pass precision="fp32".
    from pc_compat.colossalai.booster.plugin import GeminiPlugin

    if case == "offload_optim_frac":
        plugin = GeminiPlugin(
            offload_optim_frac=1.0, max_prefetch=0, precision="fp32", chunk_size=4096
        )
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.module.chunks
        assert not any(c.shard_on_device for c in model.module.chunks)
        assert model.module.manager.prefetch is False
        _matches(_gpt2, losses, booster, model)
    elif case == "chunk_config_dict":
        plugin = GeminiPlugin(chunk_config_dict={2: {"chunk_size": 8192}}, precision="fp32")
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.module.manager.chunk_size == 8192
        _matches(_gpt2, losses, booster, model)
    elif case == "hidden_dim":  # the chunk-size search steps by it
        plugin = GeminiPlugin(hidden_dim=1000, precision="fp32")
        losses, booster, model = _train(plugin, _gpt2, 3)
        assert model.module.manager.chunk_size % 1000 == 0, model.module.manager.chunk_size
        _matches(_gpt2, losses, booster, model)
    elif case == "force_outputs_fp32":
        booster = Booster(plugin=GeminiPlugin(precision="bf16", force_outputs_fp32=True))
        built = _gpt2()
        model, *_ = booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
        ids = _ids(0, 2)
        assert model(input_ids=ids, labels=ids).logits.dtype == torch.float32
        booster = Booster(plugin=GeminiPlugin(precision="bf16"))
        built = _gpt2()
        model, *_ = booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
        assert model(input_ids=ids, labels=ids).logits.dtype == torch.bfloat16
    elif case == "verbose":
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            plugin = GeminiPlugin(verbose=True, enable_gradient_accumulation=True)
            booster = Booster(plugin=plugin)
            built = _gpt2()
            booster.boost(built, torch.optim.SGD(built.parameters(), lr=0.1))
        assert ("chunks" in printed.getvalue()) == (dist.get_rank() == 0), printed.getvalue()
    elif case == "refused":
        for kwargs, message in (
            ({"shard_param_frac": 0.5}, "shards every chunk over the ranks"),
            ({"offload_optim_frac": 0.5, "offload_param_frac": 0.25}, "give one fraction"),
            ({"max_prefetch": -1}, "max_prefetch must be >= 0"),
            ({"tp_size": 3}, "tp_size=3 must divide the 2 ranks"),
            ({"extra_dp_size": 3}, "extra_dp_size=3 must divide the 2 ranks"),
            ({"norm_type": 1.0}, "global 2-norm"),
            ({"master_weights": False}, "fp32 masters of each chunk shard"),
            ({"chunk_config_dict": {}}, "as search_chunk_configuration returns"),
            ({"strict_ddp_mode": True}, "use TorchDDPPlugin"),
            ({"fp8_communication": True}, "no fp8 path"),
        ):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                GeminiPlugin(**kwargs)
        plugin = GeminiPlugin(
            step_in_backward=True, enable_gradient_accumulation=True, precision="fp32"
        )
        with pytest.raises(ValueError, match="gradients cannot accumulate"):
            plugin.validate_later(accumulation=2)  # what booster.no_sync asks
        # Tuning knobs of Colossal-AI's own placement: accepted, no effect on values
        GeminiPlugin(steady_cuda_cap_ratio=0.5, enable_async_reduce=False, chunk_init_device="cpu")
    dist.barrier()


def test_gemini_arguments() -> None:
    cases = ["offload_optim_frac", "chunk_config_dict", "hidden_dim", "force_outputs_fp32",
             "verbose", "refused"]  # fmt: skip
    run_subtests(check_gemini_arguments, 2, {"case": cases}, timeout=200)
