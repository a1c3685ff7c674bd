"""``pc-train``'s end-of-run report: ``report.json`` (everything, machine
readable), ``report.md`` (the summary a person reads) and PNG plots of the
loss curve, the throughput and each rank's peak memory (matplotlib; without
it the plots are skipped and the report says so)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report"]


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def _plots(history: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(history["step"], history["loss"], label="train loss", linewidth=1)
    if history.get("eval_step"):
        axis.plot(history["eval_step"], history["eval_loss"], "o-", label="held-out loss")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.set_title("loss")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "loss.png", dpi=100)
    plt.close(figure)
    written.append("loss.png")

    logs = history["log"]
    if logs:
        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot([e["step"] for e in logs], [e["tokens_per_s"] for e in logs], "o-")
        axis.set_xlabel("step")
        axis.set_ylabel("tokens / s (all ranks)")
        axis.set_title("throughput")
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(out / "throughput.png", dpi=100)
        plt.close(figure)
        written.append("throughput.png")

        figure, axis = plt.subplots(figsize=(7, 4))
        ranks = len(logs[-1]["peak_memory"])
        for rank in range(ranks):
            axis.plot(
                [e["step"] for e in logs],
                [e["peak_memory"][rank] / 2**20 for e in logs],
                "o-",
                label=f"rank {rank}",
            )
        axis.set_xlabel("step")
        axis.set_ylabel("peak memory (MiB)")
        axis.set_title(f"per-rank peak memory ({logs[-1]['memory_kind']})")
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / "memory.png", dpi=100)
        plt.close(figure)
        written.append("memory.png")
    return written


def write_report(out: Path, summary: dict[str, Any], history: dict[str, Any]) -> list[Path]:
    """Write the report and plots into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(history, out)
    data = {**summary, "plots": plots, "history": history}
    (out / "report.json").write_text(json.dumps(data, indent=2))
    losses = history["loss"]
    head, tail = _mean(losses[:10]), _mean(losses[-10:])
    logs = history["log"]
    rate = _mean([e["tokens_per_s"] for e in logs[1:] or logs])
    lines = [
        f"# pc-train report: {summary['model']}",
        "",
        f"- plugin: {summary['plugin']} on {summary['world']} {summary['backend']} rank(s), "
        f"precision {summary['precision']}",
        f"- parameters: {summary['params']:,}; steps {summary['steps']}, global batch "
        f"{summary['global_batch_size']} x {summary['seq_len']} tokens",
        f"- loss: {losses[0]:.4f} at the first step, {losses[-1]:.4f} at the last "
        f"(mean of the first / last 10: {head:.4f} -> {tail:.4f})",
    ]
    if history.get("eval_loss"):
        lines.append(
            f"- held-out loss: {history['eval_loss'][0]:.4f} -> {history['eval_loss'][-1]:.4f}"
        )
    if logs:
        last = logs[-1]
        tokens = summary["global_batch_size"] * summary["seq_len"]
        lines += [
            f"- throughput: {rate:,.0f} tokens/s (mean of the logged windows after the first), "
            f"{last['tflops']:.3g} TFLOPS per rank, MFU {last['mfu']:.1%} of "
            f"{summary['peak_tflops']:.3g} TFLOPS ({summary['peak_source']})",
            f"- step time: {tokens / max(rate, 1e-9):.4g} s measured, "
            f"{summary['predicted_step_seconds']:.4g} s predicted by pc-estimate",
            f"- peak memory per rank ({last['memory_kind']}): "
            + ", ".join(f"{m / 2**20:,.0f} MiB" for m in last["peak_memory"]),
        ]
    states = summary.get("model_states")
    if states:
        lines.append(
            f"- model states per rank: measured {states['measured'] / 2**20:,.2f} MiB, "
            f"pc-estimate predicted {states['predicted'] / 2**20:,.2f} MiB "
            f"(ratio {states['predicted'] / states['measured']:.3f})"
        )
    lines.append(
        f"- wall time: {summary['seconds']:.1f} s; resumed from: "
        f"{', '.join(str(s) for s in summary['resumed_at']) or 'no checkpoint'}"
    )
    if plots:
        lines += ["", *(f"![{p[:-4]}]({p})" for p in plots)]
    else:
        lines += ["", "(plots skipped: install matplotlib, or pc-booster[train])"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return [out / "report.json", out / "report.md", *(out / p for p in plots)]
