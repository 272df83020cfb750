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
2. Label agreement, on tasks whose segment text does not state the return: segments of a
   random policy (8 envs x 128 steps, cut as the plugin cuts them) on each of
   ``--label-tasks`` (``name:C:S`` gives one task its own counts), rendered by the plugin (``render_segment``) and labelled with its
   default judge and prompt (one digit, both orders). Pairs are drawn in two strata:
   ``clear`` (return difference at least the 75th percentile of the nonzero differences
   among all pairs of segments) and ``small`` (nonzero, at most the 25th percentile).
   Pairs are labelled round-robin over the tasks, clear and small alternating, until
   all are done or ``--budget-s`` has passed (``pairs`` of ``pairs_planned``).
   Per stratum: the fraction of decided labels (ties and unknowns excluded, and counted
   as abstentions) that prefer the segment with the higher return, with a percentile
   bootstrap 95 % CI over the decided pairs; the LLM calls and seconds; one rendered
   segment (``example``).

Prints one JSON object::

    {"plain_fps": ..., "progress_fps": ..., "preference_fps": ...,
     "progress_fps_ratio": ..., "preference_fps_ratio": ..., "progress_llm_calls": ...,
     "preference_labels": ..., "load_before": ..., ...,
     "labels": [{"task": "minecraft", "pairs": 20, "clear_min_diff": ..., "small_max_diff": ...,
                 "llm_calls": ..., "llm_seconds": ..., "example": "...",
                 "all": {"agreement": ..., "ci95": [lo, hi], "decided": ..., "abstain_fraction": ...,
                         "unknown": ..., "ties": ..., "mean_margin": ..., ...},
                 "clear": {...}, "small": {...}}, ...]}

Run: ``python benchmarks/llm_judge.py [--frames 65536] [--llm embedded]
[--label-tasks minecraft,lunarlander,halfcheetah] [--clear 10] [--small 10] [--budget-s 1200]``
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


def rollout_segments(task: Any, cfg: Any, envs: int, steps: int, seed: int) -> list[Any]:
    """Segments of a random policy, cut as the plugin cuts training rollouts (``split_segments``)."""
    from plugins import rlaif_preference as rp

    env = task.make_env(envs, seed)
    env.reset(seed=seed)
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "act", "rew", "term", "done")}
    for _ in range(steps):
        act = env.action_space.sample()
        nobs, rew, term, trunc, info = env.step(act)
        final = np.array(nobs, copy=True)
        for i in np.flatnonzero(np.logical_or(term, trunc)):
            final[i] = info["final_obs"][i]
        for k, v in zip(rows, (final, act, rew, term, np.logical_or(term, trunc))):
            rows[k].append(np.asarray(v))
    env.close()
    arr = {k: np.stack(v, axis=1) for k, v in rows.items()}  # [envs, T, ...]
    dim = task.obs_dim
    segments = []
    for e in range(arr["obs"].shape[0]):
        segments += rp.split_segments(arr["obs"][e][:, :dim].astype(np.float32), arr["act"][e], arr["rew"][e],
                                      arr["term"][e], arr["done"][e], cfg.segment_len, cfg.min_segment_len)
    return segments


def choose_pairs(segments: list[Any], clear: int, small: int, seed: int) -> tuple[list[tuple[Any, Any, str]], dict]:
    """``clear`` pairs whose returns differ by at least the 75th percentile of the nonzero
    return differences among all pairs, and ``small`` pairs whose (nonzero) difference is
    at most the 25th percentile; each segment in at most one pair where possible."""
    diffs = [abs(a.env_return - b.env_return) for i, a in enumerate(segments) for b in segments[i + 1:]]
    nonzero = np.array([d for d in diffs if d > 1e-6])
    if len(nonzero) == 0:
        return [], {"clear_min_diff": float("nan"), "small_max_diff": float("nan")}
    lo, hi = float(np.percentile(nonzero, 25)), float(np.percentile(nonzero, 75))
    rng = random.Random(seed)
    pool = [(a, b) for i, a in enumerate(segments) for b in segments[i + 1:]]
    rng.shuffle(pool)
    chosen: list[tuple[Any, Any, str]] = []
    used: set[int] = set()
    want = {"clear": clear, "small": small}
    for strict in (True, False):  # first with disjoint segments, then allowing reuse
        for a, b in pool:
            d = abs(a.env_return - b.env_return)
            kind = "clear" if d >= hi else "small" if 1e-6 < d <= lo else None
            if kind is None or want[kind] == 0 or (strict and (id(a) in used or id(b) in used)):
                continue
            if any(x is a and y is b for x, y, _ in chosen):
                continue
            pair = (a, b) if rng.random() < 0.5 else (b, a)
            chosen.append((*pair, kind))
            used.update((id(a), id(b)))
            want[kind] -= 1
    return chosen, {"clear_min_diff": hi, "small_max_diff": lo}


def bootstrap_ci(hits: list[bool], seed: int, n: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap 95 % CI of the mean of ``hits`` (nan when empty)."""
    if not hits:
        return float("nan"), float("nan")
    x = np.asarray(hits, np.float64)
    means = np.random.default_rng(seed).choice(x, size=(n, len(x))).mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def prepare_pairs(task_name: str, clear: int, small: int, seed: int, envs: int = 8, steps: int = 128) -> dict[str, Any]:
    """One task's labelling job: its random-policy segments, the chosen pairs (clear and
    small alternating, so that a run cut short by its time budget keeps both kinds), each
    segment rendered by the plugin (``render_segment``)."""
    from plugins import rlaif_preference as rp

    cfg = plugin_cfg("rlaif_preference")
    task = make_task({"name": task_name})
    segments = rollout_segments(task, cfg, envs, steps, seed)
    chosen, cut = choose_pairs(segments, clear, small, seed)
    kinds = {k: [p for p in chosen if p[2] == k] for k in ("clear", "small")}
    chosen = [p for pair in zip(kinds["clear"], kinds["small"]) for p in pair]
    chosen += kinds["clear"][len(kinds["small"]):] + kinds["small"][len(kinds["clear"]):]
    for seg in {id(s): s for p in chosen for s in p[:2]}.values():
        seg.text = rp.render_segment(task, seg, cfg.summary_fields)
    return {"name": task_name, "task": task, "cfg": cfg, "segments": len(segments), "chosen": chosen, "cut": cut,
            "labeller": rp.Labeller(), "rows": [], "seconds": 0.0}


def label_next(job: dict[str, Any], llm: Any) -> None:
    """Label the job's next pair with the plugin's labeller (its default judge and prompt)."""
    from plugins import rlaif_preference as rp

    a, b, kind = job["chosen"][len(job["rows"])]
    t0 = time.perf_counter()
    (lab,) = job["labeller"].label(llm, job["cfg"], job["task"].goal, [(a.text, b.text)])
    job["seconds"] += time.perf_counter() - t0
    truth = rp.env_preference(a, b)
    job["rows"].append((kind, lab, truth, abs(a.env_return - b.env_return)))
    print(f"{job['name']} pair {len(job['rows'])}/{len(job['chosen'])} ({kind}, diff {job['rows'][-1][3]:.3g}): label "
          f"{'-' if lab is None else f'{lab:.3f}'} truth {truth}; {job['seconds']:.0f} s", file=sys.stderr, flush=True)


def summarize(job: dict[str, Any], seed: int) -> dict[str, Any]:
    """Agreement with the env's return per stratum, bootstrap 95 % CIs over the decided pairs."""
    rows, chosen = job["rows"], job["chosen"]
    labelled = {id(s): s for p in chosen[: len(rows)] for s in p[:2]}.values()
    out: dict[str, Any] = {"task": job["name"], "segments": job["segments"], "pairs_planned": len(chosen),
                           "pairs": len(rows), **job["cut"], "llm_calls": job["labeller"].calls,
                           "llm_seconds": job["seconds"], "seconds_per_label": job["seconds"] / max(len(rows), 1),
                           "segment_chars_mean": float(np.mean([len(s.text) for s in labelled])) if rows else float("nan"),
                           "example": chosen[0][0].text if chosen else ""}
    for kind in ("all", "clear", "small"):
        sel = [r for r in rows if kind == "all" or r[0] == kind]
        decided = [r for r in sel if r[1] is not None and r[1] != 0.5]
        hits = [(r[1] > 0.5) == (r[2] > 0.5) for r in decided]
        lo, hi = bootstrap_ci(hits, seed)
        out[kind] = {"pairs": len(sel), "decided": len(decided), "agreement": float(np.mean(hits)) if hits else float("nan"),
                     "ci95": [lo, hi], "unknown": sum(r[1] is None for r in sel), "ties": sum(r[1] == 0.5 for r in sel),
                     "abstain_fraction": (len(sel) - len(decided)) / max(len(sel), 1),
                     "mean_margin": float(np.mean([abs(r[1] - 0.5) for r in decided])) if decided else float("nan"),
                     "mean_return_diff": float(np.mean([r[3] for r in sel])) if sel else float("nan")}
    return out


def label_agreement(tasks: list[str], llm: Any, clear: int, small: int, seed: int, budget_s: float) -> list[dict[str, Any]]:
    """Label the tasks' pairs round-robin (one pair per task in turn) until all are labelled
    or ``budget_s`` seconds have passed; a summary per task."""
    jobs = []
    for spec in tasks:  # "name" or "name:clear:small"
        name, *counts = spec.split(":")
        n_clear, n_small = (int(counts[0]), int(counts[1])) if counts else (clear, small)
        jobs.append(prepare_pairs(name, n_clear, n_small, seed))
    t0 = time.perf_counter()
    while any(len(j["rows"]) < len(j["chosen"]) for j in jobs) and time.perf_counter() - t0 < budget_s:
        for job in jobs:
            if len(job["rows"]) < len(job["chosen"]) and time.perf_counter() - t0 < budget_s:
                label_next(job, llm)
    return [summarize(j, seed) for j in jobs]


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=65536)
    parser.add_argument("--label-tasks", default="minecraft,lunarlander,halfcheetah",
                        help="comma-separated tasks whose label agreement is measured; name:C:S sets that task's clear and small pairs")
    parser.add_argument("--clear", type=int, default=10, help="pairs per task with a clear return difference")
    parser.add_argument("--small", type=int, default=10, help="pairs per task with a small return difference")
    parser.add_argument("--budget-s", type=float, default=1200.0,
                        help="labelling stops after this many seconds (pairs go round-robin over the tasks)")
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
    out: dict[str, Any] = {"frames": args.frames, "load_before": os.getloadavg()[0]}
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
        tasks = [t for t in args.label_tasks.split(",") if t]
        out["labels"] = label_agreement(tasks, llm, args.clear, args.small, args.seed, args.budget_s)
        out["load_after_labels"] = os.getloadavg()[0]
    print(json.dumps(rounded(out)))


if __name__ == "__main__":
    main()
