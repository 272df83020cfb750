"""Cost and quality of the LLM-as-judge plugins (progress_reward, rlaif_preference).

1. Frames/s of PPO on CartPole with each plugin against the plain trainer, same settings
   and seed; only training is timed (the model is loaded before the loop, periodic
   evaluation is off). The LLM works in a worker thread beside the training loop, so
   the ratio shows what async evaluation and caching leave of the trainer's speed. The
   LLM cache starts empty (a fresh folder), so every evaluation is a real generation;
   the JSON says how many evaluations finished during each timed training
   (``*_llm_calls``, ``preference_labels``) — a ratio measured while no evaluation
   finished would not measure a working judge. The plain trainer is timed before and
   after the plugins (load on a shared machine drifts); its mean is the reference.
2. Label agreement: segments of a random policy on CartPole, paired so that their env
   returns differ, labelled with the plugin's default settings (votes in both orders);
   the fraction of decided labels (ties and unknowns excluded, and counted) that prefer
   the segment with the higher return.

Prints one JSON object::

    {"plain_fps": ..., "progress_fps": ..., "preference_fps": ...,
     "progress_fps_ratio": ..., "preference_fps_ratio": ..., "progress_llm_calls": ...,
     "preference_labels": ..., "label_agreement": ..., "label_decided": ...,
     "label_pairs": ..., "label_ties": ..., "label_unknown": ..., "load_before": ..., ...}

Run: ``python benchmarks/llm_judge.py [--frames 65536] [--pairs 24] [--llm embedded]``
(``--llm fake`` answers instantly: it measures the plugins' own overhead only;
``--skip-fps`` / ``--skip-labels`` run one part).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from core.config import PluginConfig, Settings, config_class, typed  # noqa: E402
from core.context import TrainContext  # noqa: E402
from core.envs import make_task  # noqa: E402
from core.records import Candidate  # noqa: E402
from core.registry import load_plugins, make_plugin_manager  # noqa: E402
from core.resources import conf_dir  # noqa: E402
from core.train.ppo import PPOConfig, train  # noqa: E402


class FakeLLM:
    """Answers at once (score 5 / segment 1): isolates the plugins' own per-step cost."""

    class _Reply:
        def __init__(self, text: str) -> None:
            self.text, self.cached, self.latency_s, self.logprobs = text, False, 0.0, None

    def chat(self, messages: list[dict[str, str]], n: int = 1, **_: Any) -> list[Any]:
        text = "1" if "Segment 1" in messages[-1]["content"] else "Score: 5 | Reason: fine"
        return [self._Reply(text) for _ in range(n)]


def make_llm(kind: str, cache_dir: str) -> Any:
    if kind == "fake":
        return FakeLLM()
    from core.llm import make_client

    llm_cfg = OmegaConf.load(conf_dir() / "llm" / f"{kind}.yaml")
    llm_cfg.cache_path = cache_dir  # a fresh folder: no reply comes from an earlier run
    llm_cfg.show_progress = False
    return make_client(OmegaConf.to_container(llm_cfg, resolve=False))


def plugin_cfg(name: str) -> PluginConfig:
    """The plugin's validated config as ``conf/plugins/<name>.yaml`` sets it."""
    (module,) = load_plugins([name]).values()
    return typed(config_class(module), OmegaConf.load(conf_dir() / "plugins" / f"{name}.yaml"), f"plugins.{name}")


def train_fps(task: Any, plugin: str | None, frames: int, llm: Any, seed: int) -> tuple[float, dict[str, float]]:
    """Frames/s of one training (and the plugin's metrics)."""
    cfg = PPOConfig(frames=frames, eval_episodes=0, eval_every=0)
    hook, ctx = None, None
    if plugin:
        # the settings a run with +plugins=[<plugin>] would have; no policy files are saved
        settings = Settings.of({"seed": seed, "save_policy": False}, {plugin: plugin_cfg(plugin)})
        hook = make_plugin_manager(settings).hook
        ctx = TrainContext(settings=settings, task=task, seed=seed, llm_factory=lambda: llm, hook=hook,
                           candidate=Candidate("bench", 0), total_frames=frames)
    result = train(task, Candidate("bench", 0), cfg, seed=seed, hook=hook, ctx=ctx)
    if not result.ok:
        raise RuntimeError(result.error)
    return float(result.metrics["charts/fps"]), result.metrics


def label_agreement(task: Any, llm: Any, pairs: int, seed: int) -> dict[str, float]:
    """Agreement of LLM labels with the env's return on random-policy CartPole segments."""
    from plugins import rlaif_preference as rp

    cfg = plugin_cfg("rlaif_preference")
    env = task.make_env(8, seed)
    obs, _ = env.reset(seed=seed)
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "act", "rew", "term", "done")}
    for _ in range(64):
        act = env.action_space.sample()
        nobs, rew, term, trunc, info = env.step(act)
        final = np.array(nobs, copy=True)
        for i in np.flatnonzero(np.logical_or(term, trunc)):
            final[i] = info["final_obs"][i]
        for k, v in zip(rows, (final, act, rew, term, np.logical_or(term, trunc))):
            rows[k].append(np.asarray(v))
    env.close()
    arr = {k: np.stack(v, axis=1) for k, v in rows.items()}
    segments = []
    for e in range(arr["obs"].shape[0]):
        segments += rp.split_segments(arr["obs"][e].astype(np.float32), arr["act"][e], arr["rew"][e], arr["term"][e],
                                      arr["done"][e], cfg.segment_len, cfg.min_segment_len)
    rng = random.Random(seed)
    chosen = []
    while len(chosen) < pairs:
        a, b = rng.sample(segments, 2)
        if rp.env_preference(a, b) != 0.5:
            chosen.append((a, b))
    for seg in (s for p in chosen for s in p):
        seg.text = rp.render_segment(task, seg, cfg.summary_fields)
    labeller = rp.Labeller()
    t0 = time.perf_counter()
    labels: list[float | None] = []
    truths = [rp.env_preference(a, b) for a, b in chosen]
    for k, (a, b) in enumerate(chosen):  # pair by pair, with a running tally on stderr
        labels += labeller.label(llm, cfg, task.goal, [(a.text, b.text)])
        acc, decided = rp.label_accuracy(labels, truths[: k + 1])
        print(f"pair {k + 1}/{len(chosen)}: label {labels[-1]} truth {truths[k]}; agreement {acc:.2f} over {decided} "
              f"decided; {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    acc, decided = rp.label_accuracy(labels, truths)
    return {"label_agreement": acc, "label_decided": decided, "label_pairs": len(chosen),
            "label_ties": sum(x == 0.5 for x in labels), "label_unknown": sum(x is None for x in labels),
            "label_llm_calls": labeller.calls, "label_seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=65536)
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llm", default="embedded", help="an llm config name (conf/llm/) or 'fake'")
    parser.add_argument("--cache-dir", default=None, help="LLM reply cache folder (default: a fresh temporary one)")
    parser.add_argument("--skip-fps", action="store_true")
    parser.add_argument("--skip-labels", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = make_task({"name": "cartpole"})
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="llm_judge_cache_")
    llm = make_llm(args.llm, cache_dir)
    if args.llm != "fake":
        from plugins.progress_reward import preload

        preload(llm)
    out: dict[str, float] = {"frames": args.frames, "load_before": os.getloadavg()[0]}
    if not args.skip_fps:
        plain = [train_fps(task, None, args.frames, llm, args.seed)[0]]
        out["progress_fps"], pm = train_fps(task, "progress_reward", args.frames, llm, args.seed)
        out["preference_fps"], fm = train_fps(task, "rlaif_preference", args.frames, llm, args.seed)
        plain.append(train_fps(task, None, args.frames, llm, args.seed)[0])
        out["plain_fps"] = float(np.mean(plain))
        out["plain_fps_spread"] = abs(plain[1] - plain[0]) / out["plain_fps"]
        out["progress_fps_ratio"] = out["progress_fps"] / out["plain_fps"]
        out["preference_fps_ratio"] = out["preference_fps"] / out["plain_fps"]
        for key in ("judge/llm_calls", "judge/cache_hits", "judge/distilled", "judge/fallbacks", "judge/latency_llm_s",
                    "judge/latency_distilled_s", "judge/dropped"):
            out["progress_" + key.split("/", 1)[1]] = pm.get(key, 0.0)
        for key in ("preference/labels", "preference/label_accuracy", "judge/llm_calls", "judge/latency_llm_s"):
            out["preference_" + key.split("/", 1)[1]] = fm.get(key, 0.0)
        out["load_after_fps"] = os.getloadavg()[0]
    if not args.skip_labels:
        out.update(label_agreement(task, llm, args.pairs, args.seed))
        out["load_after_labels"] = os.getloadavg()[0]
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))


if __name__ == "__main__":
    main()
