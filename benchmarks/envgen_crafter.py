"""Crafter score of plain PPO against EnvGen's generated training envs, at equal frames.

For each seed: one run of plain PPO on Crafter (``env=minecraft``) for ``--frames``, and one
run per EnvGen variant with ``+plugins=[envgen]`` and ``--cycles`` generation cycles:

- ``continue`` (the paper's way, the default): one agent across the cycles, each cycle
  training in the generated envs, then in the original env; ``--frames`` is split over
  the cycles, so the final agent trains exactly the frames plain PPO does. Its score is
  the final agent's (the run's best is the policy no later cycle continued).
- ``scratch``: every cycle trains a fresh agent for ``--frames`` on a mix of the original
  env and the generated ones; its score is the best cycle's (a search over cycles, which
  spends ``cycles`` times the frames).

Every score is the Crafter score (percent) on the original env, episodes sampled from the
policy. Prints one JSON object with the scores per seed, the means, wins over the
baseline, the seconds and the machine's load average before and after.

    python benchmarks/envgen_crafter.py --seeds 0 1 --frames 30000 --cycles 2    # ~30-60 min on 2 busy cores
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from core.loop import run_experiment
from core.resources import conf_dir

VARIANTS = {"continue": "plugins.envgen.continue_training=true", "scratch": "plugins.envgen.continue_training=false"}


def run_one(variant: str | None, seed: int, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    """One run; ``variant`` None is plain PPO. Returns its score, frames and LLM figures."""
    overrides = [
        "env=minecraft",
        f"env.max_episode_steps={args.episode_steps}",
        f"seed={seed}",
        f"trainer.frames={args.frames}",
        f"trainer.num_envs={args.num_envs}",
        "trainer.rollout_steps=128",
        "trainer.epochs=4",
        "trainer.minibatch=512",
        "trainer.ent_coef=0.01",
        "trainer.gamma=0.95",
        f"trainer.eval_episodes={args.eval_episodes}",
        "trainer.eval_every=0",
        "executor=inprocess",
        # Crafter's protocol samples the policy; greedy short-trained policies collapse to one action
        "trainer.eval_deterministic=false",
        "progress=false",
        "save_policy=false",
        "resume=false",
    ]
    if variant is not None:
        overrides += [
            "+plugins=[envgen]",
            VARIANTS[variant],
            f"plugins.envgen.iterations={args.cycles}",
            f"plugins.envgen.num_envs={args.generated}",
            f"plugins.envgen.max_tokens={args.max_tokens}",
            f"plugins.envgen.generated_share={args.generated_share}",
        ]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.tracking.uri = f"sqlite:///{scratch / 'mlflow.db'}"
        cfg.tracking.artifact_location = str(scratch / "mlartifacts")
        cfg.tracking.log_plots = False
        cfg.cache_dir = str(args.cache_dir or scratch / "cache")
        cfg.experiment = "envgen-crafter-benchmark"
    start = time.perf_counter()
    summary = run_experiment(cfg)
    return {
        "score": float(summary.fitness),
        "frames": summary.frames,
        "seconds": round(time.perf_counter() - start, 1),
        "llm_calls": summary.llm.get("llm/calls", 0.0),
        "llm_tokens": summary.llm.get("llm/completion_tokens", 0.0),
        "llm_seconds": round(summary.llm.get("llm/wait_s", 0.0), 1),
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--frames", type=int, default=100_000, help="training frames of plain PPO and of EnvGen's final agent"
    )
    parser.add_argument("--cycles", type=int, default=4, help="EnvGen cycles (paper: 4)")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["continue"])
    parser.add_argument(
        "--generated-share", type=float, default=0.5, help="continue: share of each cycle in the generated envs"
    )
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--generated", type=int, default=4, help="env configs the LLM writes per cycle")
    parser.add_argument("--max-tokens", type=int, default=600, help="cap on the LLM's reply")
    parser.add_argument("--episode-steps", type=int, default=10_000, help="Crafter episode length")
    parser.add_argument("--eval-episodes", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=None, help="LLM reply cache (default: a scratch dir)")
    args = parser.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    start, load_before, commit = time.perf_counter(), os.getloadavg(), _commit()  # the code as it starts
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], **{v: [] for v in args.variants}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs["baseline"].append(run_one(None, seed, args, Path(tmp)))
            for variant in args.variants:
                runs[variant].append(run_one(variant, seed, args, Path(tmp)))
    baseline = [r["score"] for r in runs["baseline"]]
    out: dict[str, object] = {
        "benchmark": "envgen_crafter",
        "frames": args.frames,
        "cycles": args.cycles,
        "seeds": args.seeds,
        "generated_envs": args.generated,
        "generated_share": args.generated_share,
        "episode_steps": args.episode_steps,
        "eval_episodes": args.eval_episodes,
        "baseline_score": baseline,
        "baseline_mean": statistics.fmean(baseline),
    }
    for variant in args.variants:
        scores = [r["score"] for r in runs[variant]]
        out[f"{variant}_score"] = scores
        out[f"{variant}_mean"] = statistics.fmean(scores)
        out[f"{variant}_wins"] = sum(s > b for s, b in zip(scores, baseline))
        out[f"{variant}_frames"] = [r["frames"] for r in runs[variant]]
        out[f"{variant}_llm_calls"] = [r["llm_calls"] for r in runs[variant]]
        out[f"{variant}_llm_tokens"] = [r["llm_tokens"] for r in runs[variant]]
        out[f"{variant}_llm_seconds"] = [r["llm_seconds"] for r in runs[variant]]
        out[f"{variant}_seconds"] = [r["seconds"] for r in runs[variant]]
    out["baseline_frames"] = [r["frames"] for r in runs["baseline"]]
    out["baseline_seconds"] = [r["seconds"] for r in runs["baseline"]]
    out.update(
        {
            "seconds": round(time.perf_counter() - start, 1),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "commit": commit,
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
