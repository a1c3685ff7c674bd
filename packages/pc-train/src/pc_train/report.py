"""``pc-train``'s end-of-run report: ``report.json`` (everything, machine
readable), ``report.md`` (the summary a person reads) and PNG plots of the
loss curve, the throughput and each rank's peak memory (matplotlib; without
it the plots are skipped and the report says so)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pc_booster.checkpoint.export import atomic_write
from pc_train.checkpoint import private_dir

__all__ = ["closing_lines", "write_report"]


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


Series = list[tuple[list[float], list[float], str, str]]  # x, y, line style, label


def _plots(history: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []

    def figure(name: str, title: str, ylabel: str, series: Series) -> str:
        fig, axis = plt.subplots(figsize=(7, 4))
        for x, y, style, label in series:
            axis.plot(x, y, style, label=label, linewidth=1)
        axis.set_xlabel("step")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if any(label for *_, label in series):
            axis.legend()
        fig.tight_layout()
        atomic_write(out / name, lambda p: fig.savefig(p, dpi=100, format="png"))
        plt.close(fig)
        return name

    losses: Series = [(history["step"], history["loss"], "-", "train loss")]
    if history.get("eval_step"):
        losses.append((history["eval_step"], history["eval_loss"], "o-", "held-out loss"))
    written = [figure("loss.png", "loss", "loss", losses)]
    logs = history["log"]
    if logs:
        steps = [e["step"] for e in logs]
        rates = [e["tokens_per_s"] for e in logs]
        written.append(
            figure(
                "throughput.png", "throughput", "tokens / s (all ranks)", [(steps, rates, "o-", "")]
            )
        )
        # A run resumed at another world size logged fewer or more ranks
        # before it: each rank's line covers the entries that have it.
        ranks = max(len(e["peak_memory"]) for e in logs)
        memory: Series = [
            (
                [e["step"] for e in logs if r < len(e["peak_memory"])],
                [e["peak_memory"][r] / 2**20 for e in logs if r < len(e["peak_memory"])],
                "o-",
                f"rank {r}",
            )
            for r in range(ranks)
        ]
        title = f"per-rank peak memory ({logs[-1]['memory_kind']})"
        written.append(figure("memory.png", title, "peak memory (MiB)", memory))
    return written


def write_report(out: Path, summary: dict[str, Any], history: dict[str, Any]) -> list[Path]:
    """Write the report and plots into ``out``; returns the paths written."""
    private_dir(out)
    plots = _plots(history, out)
    data = {**summary, "plots": plots, "history": history}
    text = json.dumps(data, indent=2)
    atomic_write(out / "report.json", lambda p: p.write_text(text))
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
    by_phase = summary.get("memory_by_phase") or []
    if by_phase:
        from pc_train.memory import PHASES

        def mib(phase: str) -> str:
            values = [f"{rank.get(phase, 0.0) / 2**20:,.0f}" for rank in by_phase]
            return "/".join(values)

        seen = [phase for phase in PHASES if any(phase in rank for rank in by_phase)]
        lines.append(
            f"- peak memory by phase, MiB per rank ({summary.get('memory_kind', '')}): "
            + "; ".join(f"{phase} {mib(phase)}" for phase in seen)
        )
    saves = history.get("save") or []
    if saves:
        stalls = [entry["stall_s"] for entry in saves]
        kind = "async" if saves[-1]["async"] else "synchronous"
        lines.append(
            f"- checkpoint saves: {len(saves)} ({kind}), training stalled "
            f"{sum(stalls) / len(stalls):.3f} s per save (at most {max(stalls):.3f} s)"
        )
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
        lines += ["", "(plots skipped: pip install matplotlib, a dependency of pc-train)"]
    atomic_write(out / "report.md", lambda p: p.write_text("\n".join(lines) + "\n"))
    return [out / "report.json", out / "report.md", *(out / p for p in plots)]


def closing_lines(history: dict[str, Any], seconds: float, written: list[Path]) -> str:
    """A run's last lines: the train loss (means of the first and last 10
    steps), the held-out loss, and the report's files."""
    losses = history["loss"]
    head = sum(losses[:10]) / min(10, len(losses))
    tail = sum(losses[-10:]) / min(10, len(losses))
    eval_text = ""
    if history["eval_loss"]:
        eval_text = (
            f", held-out loss {history['eval_loss'][0]:.3f} -> {history['eval_loss'][-1]:.3f}"
        )
    return (
        f"done in {seconds:.1f} s: train loss {head:.3f} -> {tail:.3f} (mean of first / last "
        f"10 steps){eval_text}\nreport: {', '.join(str(p) for p in written)}"
    )
