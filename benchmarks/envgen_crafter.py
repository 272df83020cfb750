"""Crafter score of PPO with and without EnvGen's generated training envs, same frame budget.

For each seed: one run of plain PPO on Crafter (``env=minecraft``), and one run with
``+plugins=[envgen]`` (one generation cycle: the LLM writes ``num_envs`` configs, the
agent trains on the mix of those and the original env). Both train the same number of
frames and are scored on the original env (Crafter score, percent). Prints one JSON
object; ``envgen_score`` and ``baseline_score`` are lists per seed.

    python benchmarks/envgen_crafter.py --seeds 0 1 2 --frames 100000    # ~15-20 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from core.loop import run_experiment
from core.resources import conf_dir


def run_one(plugins: list[str], seed: int, args: argparse.Namespace, scratch: Path) -> float:
    overrides = [
        "env=minecraft", f"env.max_episode_steps={args.episode_steps}", f"seed={seed}",
        f"trainer.frames={args.frames}", f"trainer.num_envs={args.num_envs}", "trainer.rollout_steps=128",
        "trainer.epochs=4", "trainer.minibatch=512", "trainer.ent_coef=0.01", "trainer.gamma=0.95",
        f"trainer.eval_episodes={args.eval_episodes}", "trainer.eval_every=0", "executor=inprocess",
        "trainer.eval_deterministic=false",  # Crafter's protocol samples the policy; greedy short-trained policies collapse to one action
        "progress=false", "save_policy=false", "resume=false",
    ]
    if plugins:
        overrides += [f"+plugins=[{','.join(plugins)}]", "plugins.envgen.iterations=1", f"plugins.envgen.num_envs={args.generated}",
                      f"plugins.envgen.max_tokens={args.max_tokens}"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.tracking.uri = f"sqlite:///{scratch / 'mlflow.db'}"
        cfg.tracking.artifact_location = str(scratch / "mlartifacts")
        cfg.tracking.log_plots = False
        cfg.cache_dir = str(args.cache_dir or scratch / "cache")
        cfg.experiment = "envgen-crafter-benchmark"
    return float(run_experiment(cfg).fitness)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--frames", type=int, default=100_000, help="training frames per run (both arms)")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--generated", type=int, default=4, help="env configs the LLM writes")
    parser.add_argument("--max-tokens", type=int, default=600, help="cap on the LLM's reply")
    parser.add_argument("--episode-steps", type=int, default=10_000, help="Crafter episode length")
    parser.add_argument("--eval-episodes", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=None, help="LLM reply cache (default: a scratch dir)")
    args = parser.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    start = time.perf_counter()
    envgen, baseline = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            baseline.append(run_one([], seed, args, Path(tmp)))
            envgen.append(run_one(["envgen"], seed, args, Path(tmp)))
    out = {
        "benchmark": "envgen_crafter",
        "frames": args.frames,
        "seeds": args.seeds,
        "envgen_score": envgen,
        "baseline_score": baseline,
        "envgen_mean": statistics.fmean(envgen),
        "baseline_mean": statistics.fmean(baseline),
        "envgen_wins": sum(e > b for e, b in zip(envgen, baseline)),
        "episode_steps": args.episode_steps,
        "generated_envs": args.generated,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
