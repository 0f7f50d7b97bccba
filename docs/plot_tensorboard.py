"""Draw docs/images/digits-loss.png from a run's TensorBoard event files.

A developer's tool, not part of pstrain (it needs matplotlib, which pstrain does not
install):

    pip install matplotlib
    pstrain run examples/digits.yaml --checkpoint-dir /tmp/digits
    python docs/plot_tensorboard.py /tmp/digits/tensorboard docs/images/digits-loss.png

It reads the event files with TensorBoard's own reader (`EventAccumulator`), so the
picture shows what `tensorboard --logdir` shows: the chief's `train/loss` and, on a
second axis, `eval/accuracy`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", help="a run's tensorboard/ directory")
    parser.add_argument("output", help="the PNG to write")
    parser.add_argument("--title", default="examples/digits.yaml: pstrain run, 2 workers, "
                        "async")
    args = parser.parse_args(list(argv))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(args.logdir)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if "train/loss" not in tags:
        print(f"{args.logdir}: no train/loss scalars (tags: {tags})", file=sys.stderr)
        return 1
    loss = acc.Scalars("train/loss")
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    ax.plot([e.step for e in loss], [e.value for e in loss], color="tab:blue",
            marker=".", label="train/loss (chief, averaged between curve points)")
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if "eval/accuracy" in tags:
        accuracy = acc.Scalars("eval/accuracy")
        ax2 = ax.twinx()
        ax2.plot([e.step for e in accuracy], [e.value for e in accuracy],
                 color="tab:orange", marker="o", label="eval/accuracy (held-out)")
        ax2.set_ylabel("accuracy")
        ax2.set_ylim(0.0, 1.0)
        more = ax2.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="center right", fontsize=8)
    ax.set_title(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
