"""Learning curves of drafter training: held-out tau estimate and loss per domain against steps.

    python scripts/plot_training_log.py RUN1/log.jsonl [RUN2/log.jsonl ...] --out curves.png

Logs are drawn one after another on the step axis, in the order given (a run started with
--init-from continues the one before it); a dashed line marks where each later run starts.
Needs matplotlib (the `eval` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    """The evaluation records of one training log (lines without held-out numbers are skipped)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if "tau_estimate" in r]


def curves(logs: list[list[dict]]) -> tuple[dict[str, list[tuple]], list[int]]:
    """{domain: [(global step, tau estimate, held-out loss, decoding tau estimate or None)]} over all logs
    (logs written before the decoding estimate existed have None), and each later log's first step."""
    points: dict[str, list[tuple]] = {}
    offset, starts = 0, []
    for records in logs:
        if offset:
            starts.append(offset)
        for r in records:
            domains = r.get("domains") or {"all": r}
            for name, d in domains.items():
                points.setdefault(name, []).append((offset + r["step"], d["tau_estimate"], d["eval_loss"],
                                                    d.get("decode_tau_estimate")))
        offset += max((r["step"] for r in records), default=0)
    return points, starts


def plot(points, starts, out: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot state or GUI backend

    fig = Figure(figsize=(10, 4))
    tau_ax, loss_ax = fig.subplots(1, 2)
    for name, series in sorted(points.items()):
        steps = [p[0] for p in series]
        line, = tau_ax.plot(steps, [p[1] for p in series], marker="o", label=f"{name} (all anchors)")
        decoding = [(p[0], p[3]) for p in series if p[3] is not None]
        if decoding:  # what decoding would see: the figure eval.* measure
            tau_ax.plot(*zip(*decoding), marker="s", linestyle="--", color=line.get_color(), label=f"{name} (decoding)")
        loss_ax.plot(steps, [p[2] for p in series], marker="o", label=name)
    for ax, label in ((tau_ax, "held-out tau estimate"), (loss_ax, "held-out loss")):
        for s in starts:
            ax.axvline(s, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="log.jsonl files of train_drafter.py runs, in training order")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="drafter training")
    args = p.parse_args(argv)
    points, starts = curves([read_log(path) for path in args.logs])
    if not points:
        raise SystemExit("error: no evaluation records in the logs (train with --eval-every)")
    plot(points, starts, Path(args.out), args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
