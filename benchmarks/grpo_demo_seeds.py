"""Does the shipped CPU demo learn? Mean reward early vs late, over three seeds.

    python -m benchmarks.grpo_demo_seeds [--manifest PATH] [--seeds 0 1 2]

Prints, per seed, the mean reward over the first and last 10% of steps, then
the mean rise across seeds against the spread (standard deviation across
seeds) of the final reward.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(ROOT / "agilerl/examples/grpo_tiny_cpu.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args()

    from agilerl.manifest import load_manifest
    from agilerl.train import train

    rows = []
    for seed in args.seeds:
        manifest = load_manifest(args.manifest)
        manifest.training.seed = seed
        history = train(manifest, device="cpu", max_steps=args.max_steps)[0]  # it logs, prints nothing
        rewards = [m["mean_reward"] for m in history]
        k = max(1, len(rewards) // 10)
        rows.append((seed, statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:]), len(rewards)))
    print(f"{'seed':>4} {'steps':>5} {'first 10%':>10} {'last 10%':>10} {'rise':>7}")
    for seed, first, last, n in rows:
        print(f"{seed:>4} {n:>5} {first:>10.3f} {last:>10.3f} {last - first:>+7.3f}")
    rises = [last - first for _, first, last, _ in rows]
    finals = [last for _, _, last, _ in rows]
    spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
    print(f"mean rise {statistics.fmean(rises):+.3f}; spread of the final reward across seeds (std) {spread:.3f}")


if __name__ == "__main__":
    main()
