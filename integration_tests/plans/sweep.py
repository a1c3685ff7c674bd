"""The plan sweep: every model family of the installed ``transformers`` that
has a tensor-parallel plan, built tiny (``families.py``), trained 3 steps
under tensor parallelism 2, tensor parallelism 2 with sequence parallelism,
and a 2-stage pipeline (1F1B), each against single-process training of the
same model on the same batch (losses and parameters, rtol 1e-4). A family
pc refuses counts as refused, with the reason.

``python integration_tests/plans/sweep.py [--families llama qwen2 ...]
[--write docs/plan-sweep.md]`` prints a table and "N of M families pass";
``nox -s plans`` runs it over every family. ``test_plan_sample.py`` runs a
sample of it in ``nox -s tests``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from families import (
    SEQ,
    STOCHASTIC,
    VOCAB,
    Family,
    Skip,
    build,
    families,
    families_without_plan,
    family,
)

STEPS, LR, BATCH, LABELS = 3, 0.1, 4, 3
RTOL, ATOL = 1e-4, 1e-5
# tp: tensor parallelism 2; sp: with sequence parallelism; pp: a 2-stage
# 1F1B pipeline; cls: tp 2 and pp 2 with the family's sequence- and token-
# classification heads; tp-pp: tp 2 x pp 2 at world 4 (its own group);
# ep: expert parallelism 2 (mixture-of-experts families, the router's
# auxiliary loss on).
MODES = ("tp", "sp", "pp", "cls")
EP_MODES = (*MODES, "ep")  # the sample test's; the ep sweep has a page of its own
MOE: dict[str, Any] = {"output_router_logits": True, "router_aux_loss_coef": 0.1}


class Refused(Exception):  # noqa: N818  (a result, not an error)
    """pc refused the family, with the reason."""


def _batches(head: str = "causal") -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
        if head == "sequence":
            labels = torch.randint(0, LABELS, (BATCH,), generator=gen)
        elif head == "token":
            labels = torch.randint(0, LABELS, (BATCH, SEQ), generator=gen)
        else:
            labels = ids
        out.append({"input_ids": ids, "labels": labels})
    return out


def _loss(model: nn.Module, batch: dict[str, torch.Tensor], head: str) -> torch.Tensor:
    if head == "base":  # a base model alone: a loss over its last hidden states
        hidden = model(input_ids=batch["input_ids"]).last_hidden_state
        base: torch.Tensor = hidden.float().square().mean()
        return base
    loss: torch.Tensor = model(**batch).loss
    return loss


def _model(family: Family, head: str) -> nn.Module:
    return build(family, head=head, num_labels=LABELS) if head != "causal" else build(family)


def _train(model: nn.Module, head: str) -> list[torch.Tensor]:
    """The sweep's steps (SGD) on ``model``, one process's view; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in _batches(head):
        loss = _loss(model, batch, head)
        loss.backward()  # type: ignore[no-untyped-call, unused-ignore]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _reference(
    family: Family, head: str = "causal"
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = _model(family, head)
    losses = _train(model, head)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(
    what: str,
    losses: list[torch.Tensor],
    state: dict[str, torch.Tensor],
    ref: tuple[list[torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    ref_losses, ref_state = ref
    torch.testing.assert_close(
        torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL,
        msg=lambda m: f"{what}: losses differ from single-process training: {m}",
    )  # fmt: skip
    missing = sorted(set(ref_state) - set(state))
    assert not missing, f"{what}: the trained state lacks {missing[:3]}"
    for key, value in ref_state.items():
        prefix = f"{what}: {key} differs after {STEPS} steps"
        torch.testing.assert_close(
            state[key].float(), value.float(), rtol=RTOL, atol=ATOL,
            msg=lambda m, prefix=prefix: f"{prefix}: {m}",  # type: ignore[misc]
        )  # fmt: skip


def check_tp(family: Family, sp: bool, ref: Any, head: str = "causal") -> None:
    from pc_tensor import full_state_dict, shard_model

    model = _model(family, head)
    try:
        shard_model(model, dist.group.WORLD, sequence_parallel=sp)
    except (ValueError, TypeError) as error:
        raise Refused(str(error)) from None
    losses = _train(model, head)
    _compare("sp" if sp else f"tp ({head})", losses, full_state_dict(model), ref)


def check_pp(family: Family, ref: Any, head: str = "causal", tp: int = 1) -> None:
    from pc_booster import Booster, HybridParallelPlugin

    model = _model(family, head)
    try:
        plugin = HybridParallelPlugin(pp_size=2, tp_size=tp, num_microbatches=2, pp_timeout=20.0)
        booster = Booster(plugin=plugin)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        pipe, opt, *_ = booster.boost(model, opt)
    except (ValueError, TypeError) as error:
        raise Refused(str(error)) from None
    losses = []
    for step, batch in enumerate(_batches(head)):
        try:
            out = booster.execute_pipeline(iter([batch]), pipe, None, opt)
        except ValueError as error:
            if step:
                raise
            # What only a forward shows (blocks sharing state): refused there.
            raise Refused(f"(at the first step) {error}") from None
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].detach())
    state = plugin.model_state_dict(pipe)
    _compare(f"pp ({head}, tp {tp})" if tp > 1 else f"pp ({head})", losses, state, ref)


def check_ep(family: Family, head: str = "causal") -> str:
    """The experts split over 2 ranks (``pc_tensor.shard_experts``), every
    rank given the whole batch: dense gradients are then the single
    process's on each rank, and each expert's, summed over both ranks'
    tokens and divided by ep, too; the expert rows gathered for the
    comparison. With the router's auxiliary loss on, unless the model's
    own auxiliary loss fails in one process (then without it, and said)."""
    from pc_tensor import (
        ShardSpec,
        find_experts,
        is_expert_parameter,
        shard_experts,
        unshard_tensor,
    )

    probe = build(family, head=head, **MOE)
    try:
        if not find_experts(probe):
            raise Skip("not a mixture-of-experts model (no experts module)")
    except ValueError as error:
        raise Refused(str(error)) from None
    overrides, note = MOE, " (base model)" if head == "base" else ""
    try:
        ref = _reference_with(family, MOE, head)
    except Exception as error:  # the model's own auxiliary loss, in one process
        overrides = {}
        note = f" (aux loss off: in one process it fails, {type(error).__name__}: {error})"
        ref = _reference_with(family, overrides, head)
    model = build(family, head=head, **overrides)
    try:
        shard_experts(model)
    except ValueError as error:
        raise Refused(str(error)) from None
    losses = _train(model, head)
    world = dist.group.WORLD
    assert world is not None
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        if is_expert_parameter(param):
            state[name] = unshard_tensor(param.detach(), ShardSpec(dim=0), world)
    _compare("ep", losses, state, ref)
    return "pass" + note[:200]


def _reference_with(
    family: Family, overrides: dict[str, Any], head: str = "causal"
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = build(family, head=head, **overrides)
    losses = _train(model, head)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_classification(family: Family) -> str:
    """tp 2 and pp 2 with each classification head the family has."""
    done = []
    for head in ("sequence", "token"):
        try:
            ref = _reference(family, head)
        except Skip:
            continue
        check_tp(family, False, ref, head)
        check_pp(family, ref, head)
        done.append(head)
    if not done:
        raise Skip("no sequence- or token-classification class")
    return "pass (" + ", ".join(done) + ")"


def _run_family(family: Family, modes: tuple[str, ...]) -> dict[str, str]:
    result: dict[str, str] = {}
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        head = "causal"
        if family.model_type in STOCHASTIC:
            return dict.fromkeys(modes, f"skip: {STOCHASTIC[family.model_type]}")
        try:
            try:
                ref = _reference(family)
            except Skip as skip:
                if "no AutoModelForCausalLM" not in str(skip):
                    raise
                head = "base"  # a multimodal family's text model: its blocks alone
                ref = _reference(family, head)
        except Skip as skip:
            return dict.fromkeys(modes, f"skip: {skip}")
        except Exception as error:
            text = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            return dict.fromkeys(modes, f"skip: single-process training fails ({text})")
        for mode in modes:
            try:
                result[mode] = "pass"
                if mode in ("pp", "tp-pp") and head == "base":
                    raise Skip("no causal-LM class; its base model was trained under tp")
                if mode == "ep":
                    result[mode] = check_ep(family, head)
                elif mode == "pp":
                    check_pp(family, ref)
                elif mode == "cls":
                    result[mode] = check_classification(family)
                elif mode == "tp-pp":
                    check_pp(family, ref, tp=2)
                else:
                    check_tp(family, mode == "sp", ref, head)
                if head == "base" and mode in ("tp", "sp"):
                    result[mode] = "pass (base model)"
            except Skip as skip:
                result[mode] = f"skip: {skip}"
            except Refused as refused:
                result[mode] = "refused: " + " ".join(str(refused).split())[:300]
            except Exception as error:
                text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                result[mode] = "FAIL: " + text
            dist.barrier()
    return result


def _merge(values: list[str]) -> str:
    """One result from every rank's: a failure over a pass, and the rank
    that failed first (the others time out waiting for it) over the rest."""
    failed = [v for v in values if not v.startswith("pass")] or values
    first = [v for v in failed if "timed out" not in v.lower() and "timeout" not in v.lower()]
    return (first or failed)[0]


def _worker(names: list[str], modes: tuple[str, ...], out: str) -> None:
    for name in names:
        result = _run_family(family(name), modes)
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        if dist.get_rank() == 0:
            merged = {m: _merge([r[m] for r in results]) for m in modes}
            with open(out, "a") as handle:
                handle.write(json.dumps({"family": name, **merged}) + "\n")


def sweep(
    names: list[str], modes: tuple[str, ...] = MODES, world: int = 2, batch: int = 8
) -> list[dict[str, str]]:
    from pc_comm.testing import spawn

    rows: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.jsonl")
        todo = list(names)
        while todo:
            chunk, todo = todo[:batch], todo[batch:]
            start = time.perf_counter()
            try:
                spawn(_worker, world, args=(chunk, modes, out), timeout=120 + 60 * len(chunk))
            except Exception as error:
                print(f"group failed on {chunk}: {str(error).splitlines()[0]}", file=sys.stderr)
            done = {}
            if Path(out).exists():
                for line in Path(out).read_text().splitlines():
                    row = json.loads(line)
                    done[row["family"]] = row
            for name in chunk:
                lost = dict.fromkeys(modes, "FAIL: the group crashed or hung")
                row = done.get(name) or {"family": name, **lost}
                rows.append(row)
                print(json.dumps(row), flush=True)
            spent = time.perf_counter() - start
            print(f"  {len(chunk)} families in {spent:.0f} s", file=sys.stderr)
    return rows


def table(rows: list[dict[str, str]], modes: tuple[str, ...]) -> str:
    lines = ["| family | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for row in rows:
        cells = [row[m].replace("|", "\\|") for m in modes]
        lines.append(f"| {row['family']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# tp 2 x pp 2 needs world 4: run on this sample (shapes: GQA, packed
# projections with gathered outputs, parallel blocks, per-head norms).
TP_PP_SAMPLE = ("llama", "qwen2", "phi3", "gpt_neox", "gemma3_text")
# And of the families without a plan (inferred plan and cut).
TP_PP_INFERRED_SAMPLE = ("opt", "gpt2", "bloom")


def _page(text: str, summary: str, modes: tuple[str, ...], inferred: bool = False) -> str:
    if modes == ("ep",):
        return _ep_page(text, summary)
    if inferred:
        return _inferred_page(text, summary)
    import transformers

    return f"""# The plan sweep: tensor and pipeline parallelism for any transformers family

Written by `nox -s plans` (`integration_tests/plans/sweep.py`) on
{time.strftime("%Y-%m-%d")}, transformers {transformers.__version__}, torch
{torch.__version__}, 2 CPU ranks (gloo), 4 for `tp-pp`.

Every model family of the installed transformers whose config carries a
tensor-parallel plan (`base_model_tp_plan`) is built tiny from its config
(hidden 64, 2 layers, 4 query heads over 2 key/value heads, vocabulary
131, padded to 132 at tp 2; eager attention, dropout off) and trained {STEPS} steps (SGD, lr
{LR}, batch {BATCH} x {SEQ}) against single-process training of the same
model on the same batches: losses and every parameter within rtol
{RTOL} / atol {ATOL}.

- **tp**: `pc_tensor.shard_model` over 2 ranks, the sharding read from the
  plan; **sp**: the same with sequence parallelism;
- **pp**: `HybridParallelPlugin(pp_size=2)`, 1F1B over 2 micro-batches,
  the stages cut from the family's `base_model_pp_plan`;
- **cls**: tp 2 and pp 2 with the family's sequence- and token-
  classification heads (those it has);
- **tp-pp**: tp 2 x pp 2 at world 4, on a sample.

"refused" is pc's error, word for word: a combination it cannot do right is
refused when the model is sharded or boosted, never trained wrong. "skip"
is a family this sweep could not build tiny or train in one process.

**{summary}.** A family passes when nothing in its row fails and its first
column passes; "refused" is not a failure, "FAIL" is.

{text}
"""


def _ep_page(text: str, summary: str) -> str:
    import transformers

    return f"""# The plan sweep, expert parallelism

Written by `nox -s plans` (`integration_tests/plans/sweep.py --modes ep
--all`) on {time.strftime("%Y-%m-%d")}, transformers
{transformers.__version__}, torch {torch.__version__}, 2 CPU ranks (gloo).

Every model family of the installed transformers (with a tensor-parallel
plan, or without one but with a causal-LM class) is built tiny as in
[the plan sweep](plan-sweep.md), with the router's auxiliary loss on
(`output_router_logits=True`, coefficient 0.1). Its experts are split over
2 ranks by `pc_tensor.shard_experts` ([Expert parallelism](expert-parallel.md)),
found from the experts contract, not per family. It trains {STEPS} steps
(SGD, lr {LR}) against single-process training of the same model on the
same batches, every rank given the whole batch: losses and every parameter
(the expert rows gathered) within rtol {RTOL} / atol {ATOL}.

Families without experts are left out of the table. "skip" is a family
this sweep could not build tiny or train in one process. "pass (aux loss
off ...)" is a family whose own auxiliary loss fails in one process, so it
was checked without it.

**{summary}.** "refused" is not a failure, "FAIL" is.

{text}
"""


def _inferred_page(text: str, summary: str) -> str:
    import transformers

    return f"""# The plan sweep, families without a plan

Written by `nox -s plans` (`integration_tests/plans/sweep.py --inferred`) on
{time.strftime("%Y-%m-%d")}, transformers {transformers.__version__}, torch
{torch.__version__}, 2 CPU ranks (gloo).

Every model family of the installed transformers whose config carries no
tensor-parallel plan but which has a causal-LM class, built tiny and
trained as in [the plan sweep](plan-sweep.md). pc infers the plan
(`pc_tensor.infer_plan`: attention projections and MLP up / down layers)
and cuts the pipeline from the module tree (embeddings, the list of
repeated blocks, the final norm and head), and refuses a model that does
not fit that pattern, with the reason.

- **tp**, **sp**: `pc_tensor.shard_model` over 2 ranks with the inferred
  plan, without and with sequence parallelism;
- **pp**: `HybridParallelPlugin(pp_size=2)`, 1F1B over 2 micro-batches,
  the stages cut from the module tree;
- **cls**: tp 2 and pp 2 with the family's sequence- and token-
  classification heads (those it has).

**{summary}.** A family passes when nothing in its row fails and its first
column passes; "refused" is not a failure, "FAIL" is.

{text}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=None)
    parser.add_argument(
        "--all",
        action="store_true",
        help="every family, with a plan or without one (with a causal LM)",
    )
    parser.add_argument(
        "--inferred",
        action="store_true",
        help="the families without a tp plan (pc infers the plan and the pipeline cut)",
    )
    parser.add_argument(
        "--modes", nargs="*", default=[*MODES, "tp-pp"], choices=[*EP_MODES, "tp-pp"]
    )
    parser.add_argument("--tp-pp-families", nargs="*", default=list(TP_PP_SAMPLE))
    parser.add_argument("--write", default=None, help="a markdown file for the table")
    args = parser.parse_args()
    listed = families_without_plan() if args.inferred else families()
    if args.all:
        listed = [*families(), *families_without_plan()]
    names = args.families or [f.model_type for f in listed]
    if args.inferred and "tp-pp" in args.modes and args.tp_pp_families == list(TP_PP_SAMPLE):
        args.tp_pp_families = list(TP_PP_INFERRED_SAMPLE)
    modes = tuple(m for m in args.modes if m != "tp-pp")
    rows = sweep(names, modes) if modes else [{"family": n} for n in names]
    if "tp-pp" in args.modes:
        sample = [n for n in args.tp_pp_families if n in names]
        by_family = {r["family"]: r for r in sweep(sample, ("tp-pp",), world=4)}
        for row in rows:
            row["tp-pp"] = by_family.get(row["family"], {}).get("tp-pp", "not in the sample")
        modes = (*modes, "tp-pp")
    if modes == ("ep",):  # the mixture-of-experts families only
        rows = [r for r in rows if not r["ep"].startswith("skip: not a mixture")]
    built = [r for r in rows if not all(r[m].startswith(("skip", "not in")) for m in modes)]
    failed = [r for r in built if any(r[m].startswith("FAIL") for m in modes)]

    def passing(mode: str) -> list[dict[str, str]]:
        return [r for r in built if mode in r and r[mode].startswith("pass") and r not in failed]

    counts = [f"{len(passing(m))} pass {m}" for m in modes]
    kind = "without a plan, with a causal LM" if args.inferred else "with a plan"
    if modes == ("ep",):
        kind = "with experts or not built"
    summary = (
        f"{len(passing(modes[0]))} of {len(built)} families pass ({len(rows)} "
        f"{kind}; {', '.join(counts)}; {len(failed)} fail)"
    )
    text = table(rows, modes)
    print(text)
    print(summary)
    if args.write:
        Path(args.write).write_text(_page(text, summary, modes, args.inferred))


if __name__ == "__main__":
    main()
