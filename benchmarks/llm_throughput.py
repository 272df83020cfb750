"""Embedded LLM throughput: tokens/s, prefix reuse, and a Eureka round before and after.

Measures the embedded model (Qwen2.5-Coder-1.5B, llama.cpp) the way the agent loop uses
it and prints one JSON object:

- ``single_stream_tokens_per_s``: one reply decoded alone;
- ``concurrent_tokens_per_s``: ``concurrent_k`` replies of one prompt decoded together in
  the server's slots (aggregate), and ``concurrent_speedup`` over one stream; both also
  per CPU-second of the process (steadier than wall time on a shared machine);
- ``prompt_tokens_per_s_no_reuse``: the round's prompt computed from scratch;
  ``prompt_tokens_per_s_prefix_reused``: the same prompt after the previous round's prompt
  (system + task, the shared prefix) is in the cache, counted as all its tokens over the
  time it took;
- a Eureka round: the eureka plugin's prompt (``plugins.eureka_reward.messages``) for
  MountainCar in its second round (the previous best reply and its reflection appended),
  ``--samples`` replies of exactly ``--reply-tokens`` tokens each (``ignore_eos``, so both
  arms do the same work; 460 is the mean reply length measured in
  ``benchmarks/reward_design.py``), through :class:`core.llm.LLMClient` with the cache off.
  ``--round 1`` times the first round's prompt instead (shorter, no reflection).
  Arms, each in a fresh process with the same thread count, interleaved over
  ``--repeats`` (order alternating):

  - ``before``: the old path: one slot, every prompt computed from scratch, one request
    per sample served one at a time (``llm.n_parallel=1 llm.max_n=1 llm.prefix_cache=false``);
  - ``after``: the defaults (prefix reuse, 4 slots over a shared KV pool: the round is
    two requests of 4 samples, the prompt computed once);
  - ``slots8``: 8 slots, the round in one request (``llm.n_parallel=8``);
  - ``one_slot``: the server as it was configured before this benchmark existed: one slot,
    requests one at a time, and llama.cpp's own prompt cache left on, which already
    reuses the prefix a request shares with the one before it.

  ``round_time_ratio`` is after / before (mean wall times); ``round_time_ratio_one_slot``
  is after / one_slot; ``round_time_ratio_slots8`` is slots8 / before. Before a timed round
  each arm's server computes the previous round's prompt once (untimed), as a search would
  have.

Load: ``load_avg`` (1, 5, 15 min) is read at the start and end and around every round;
the machine may be shared, so compare arms within one run only.

    python benchmarks/llm_throughput.py            # round 2, 8 x 460 tokens, 3 arms x 2 repeats (1-2 h on 2 busy cores)
    python benchmarks/llm_throughput.py --quick    # round 1, 4 x 32 tokens, before/after once (a check: 3-6 min)
    python benchmarks/llm_throughput.py --threads 2 --arms before,after --repeats 3
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
import statistics
import subprocess
import time
from dataclasses import fields, replace
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

#: Overrides of the ``llm`` node per arm (on top of the embedded defaults).
ARMS: dict[str, dict[str, Any]] = {
    "before": {"n_parallel": 1, "max_n": 1, "prefix_cache": False},
    "after": {},
    "one_slot": {"n_parallel": 1, "max_n": 1, "prefix_cache": True},
    "slots8": {"n_parallel": 8, "max_n": 8, "prefix_cache": True},
}

#: The previous round's best reply (an assistant turn of typical length and style).
BEST_REPLY = """The car has to build momentum, so the reward should favour mechanical energy and
progress toward the flag rather than only the position.

```python
import torch

def compute_reward(state, action, next_state):
    position = next_state["car_position"]
    velocity = next_state["car_velocity"]
    prev_position = state["car_position"]
    prev_velocity = state["car_velocity"]

    # height of the car on the hill: sin(3x) is the track profile
    height = torch.sin(3.0 * position) * 0.45 + 0.55
    prev_height = torch.sin(3.0 * prev_position) * 0.45 + 0.55

    # kinetic energy, scaled to the same range as the height
    kinetic = 0.5 * (velocity / 0.07) ** 2
    prev_kinetic = 0.5 * (prev_velocity / 0.07) ** 2

    energy_temperature = 0.2
    energy_gain = (height + kinetic) - (prev_height + prev_kinetic)
    energy_reward = torch.tanh(energy_gain / energy_temperature)

    progress_temperature = 0.1
    progress = torch.clamp(position - prev_position, -0.05, 0.05)
    progress_reward = torch.tanh(progress / progress_temperature) * (velocity > 0).float()

    goal_reward = (position >= 0.5).float() * 10.0
    step_penalty = -0.1 * torch.ones_like(position)

    reward = energy_reward + 0.5 * progress_reward + goal_reward + step_penalty
    components = {
        "energy_reward": energy_reward,
        "progress_reward": progress_reward,
        "goal_reward": goal_reward,
        "step_penalty": step_penalty,
    }
    return reward, components
```

The energy term rewards every swing that adds momentum, the progress term pushes toward
the flag once the car moves right, and the goal bonus marks success."""


def round_messages(round_index: int) -> list[dict[str, str]]:
    """The eureka plugin's messages for MountainCar in round 1 or 2 (with a reflection)."""
    from core.config import SandboxConfig
    from core.envs import make_task
    from core.prompting import summarize_series
    from plugins import eureka_reward as eureka

    run = SimpleNamespace(task=make_task({"name": "mountaincar"}), sandbox=SandboxConfig())
    if round_index == 1:
        return eureka.messages(run, "", "")
    series = {
        "energy_reward": [0.01, 0.03, 0.02, 0.05, 0.04, 0.06, 0.05, 0.07, 0.06, 0.08],
        "goal_reward": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 0.1],
        "progress_reward": [0.12, 0.1, 0.15, 0.13, 0.16, 0.14, 0.18, 0.17, 0.19, 0.18],
        "step_penalty": [-0.1] * 10,
    }
    lines = [f"{name}: {summarize_series(values)}" for name, values in series.items()]
    lines.append(f"fitness (success_rate): {summarize_series([0.0] * 8 + [0.1, 0.0])}")
    lines.append(f"episode length: {summarize_series([200.0] * 9 + [187.0])}")
    feedback = eureka.REFLECTION.format(fitness_name="success_rate", series="\n".join(lines))
    return eureka.messages(run, BEST_REPLY, feedback)


def previous_messages(round_index: int) -> list[dict[str, str]]:
    """What the server computed before the timed round: the previous round's prompt; before
    round 1, an earlier call sharing the system prompt and the first third of the task."""
    if round_index > 1:
        return round_messages(round_index - 1)
    system, user = round_messages(1)
    return [system, {"role": "user", "content": user["content"][: len(user["content"]) // 3]}]


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -------------------------------------------------------------------------------------
# Workers (one fresh process each: the embedded server is one per process)
# -------------------------------------------------------------------------------------


def client_for(arm: str, threads: int, max_tokens: int) -> Any:
    from core.llm import make_client

    cfg = {
        "cache": False,
        "show_progress": False,
        "n_threads": threads,
        "max_tokens": max_tokens,
        "extra": {"ignore_eos": True},
        **ARMS[arm],
    }
    return make_client(cfg)


def worker_round(args: argparse.Namespace) -> dict[str, Any]:
    """One timed round of ``--samples`` replies in arm ``args.worker``."""
    from core.llm import LLMStats, embedded

    client = client_for(args.worker, args.threads, args.reply_tokens)
    current = round_messages(args.round)
    plan = embedded.get_plan()  # load outside the timing
    # the previous round's prompt, computed as that round would have (untimed)
    client.chat(previous_messages(args.round), n=1, max_tokens=1, seed=10_000, temperature=1.0)
    warm = replace(client.stats)
    load_before, cpu_before, start = load_avg(), cpu_s(), time.perf_counter()
    replies = client.chat(current, n=args.samples, temperature=1.0, seed=args.seed)
    wall = time.perf_counter() - start
    stats = LLMStats(**{f.name: getattr(client.stats, f.name) - getattr(warm, f.name) for f in fields(LLMStats)})
    return {
        "arm": args.worker,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu_s() - cpu_before, 2),
        "load_avg_before": load_before,
        "load_avg_after": load_avg(),
        "samples": len(replies),
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_reused": stats.cached_prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "previous_round_prompt_tokens": warm.prompt_tokens,
        "plan": plan.reason,
    }


def timed(messages: list[dict[str, str]], **kw: Any) -> tuple[dict[str, Any], float]:
    from core.llm import embedded

    start = time.perf_counter()
    result = embedded.generate(embedded.QWEN_CODER_1_5B.name, messages, **kw)
    return result, time.perf_counter() - start


def worker_speeds(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of one stream and of K together; prompt tokens/s with and without reuse."""
    from core.llm import embedded

    client_for("after", args.threads, args.reply_tokens)  # configures the embedded server
    plan = embedded.get_plan()
    previous, current = previous_messages(args.round), round_messages(args.round)
    load_before = load_avg()
    # the previous round's prompt, then this round's: the prefix they share is reused
    timed(previous, max_tokens=1, seed=2)
    warm, warm_wall = timed(current, max_tokens=1, seed=3)
    # the round's prompt from scratch
    cold, cold_wall = timed(current, max_tokens=1, seed=1, cache_prompt=False)
    # decoding: one stream, then K replies of one (cached) prompt together
    short = [{"role": "user", "content": "Write a long, well commented Python module of numerical helpers."}]
    timed(short, max_tokens=1, seed=4)
    cpu0 = cpu_s()
    one, one_wall = timed(short, max_tokens=args.reply_tokens, seed=5, ignore_eos=True)
    cpu1 = cpu_s()
    k = min(args.samples, plan.samples_per_request(len(short[0]["content"]), args.reply_tokens))
    many, many_wall = timed(short, n=k, max_tokens=args.reply_tokens, seed=6, ignore_eos=True)
    cpu2 = cpu_s()
    single = one["usage"]["completion_tokens"] / one_wall
    together = many["usage"]["completion_tokens"] / many_wall
    ct, wt = cold["timings"], warm["timings"]
    return {
        "speeds_plan": plan.reason,
        "speeds_load_avg_before": load_before,
        "speeds_load_avg_after": load_avg(),
        "single_stream_tokens_per_s": round(single, 2),
        "concurrent_tokens_per_s": round(together, 2),
        "concurrent_k": k,
        "concurrent_speedup": round(together / single, 2),
        "single_stream_tokens_per_cpu_s": round(one["usage"]["completion_tokens"] / max(1e-9, cpu1 - cpu0), 2),
        "concurrent_tokens_per_cpu_s": round(many["usage"]["completion_tokens"] / max(1e-9, cpu2 - cpu1), 2),
        "prompt_tokens": ct["prompt_n"] + ct["cache_n"],
        "prompt_tokens_per_s_no_reuse": round((ct["prompt_n"] + ct["cache_n"]) / (ct["prompt_ms"] / 1000), 2),
        "prompt_tokens_per_s_prefix_reused": round((wt["prompt_n"] + wt["cache_n"]) / (wt["prompt_ms"] / 1000), 2),
        "prompt_tokens_reused": wt["cache_n"],
        "prompt_wall_s_no_reuse": round(cold_wall, 2),
        "prompt_wall_s_prefix_reused": round(warm_wall, 2),
    }


# -------------------------------------------------------------------------------------
# The driver
# -------------------------------------------------------------------------------------


def spawn(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        kind,
        "--threads",
        str(args.threads),
        "--samples",
        str(args.samples),
        "--reply-tokens",
        str(args.reply_tokens),
        "--seed",
        str(args.seed),
        "--round",
        str(args.round),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"worker {kind} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {kind}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def choose_threads() -> tuple[int, str]:
    from core.llm import embedded

    plan = embedded.plan_server(embedded.EmbeddedSettings(), embedded.usable_cores(), embedded.busy_cores(1.0))
    return plan.n_threads, plan.reason.split(",")[0] + ", " + plan.reason.split(",")[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="samples per round (eureka's K)")
    parser.add_argument(
        "--reply-tokens", type=int, default=460, help="tokens per reply (every reply exactly this long)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every arm")
    parser.add_argument("--arms", default="before,after,one_slot", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument(
        "--threads", type=int, default=0, help="llama.cpp threads for every arm (0: chosen once from the free cores)"
    )
    parser.add_argument(
        "--round",
        type=int,
        default=2,
        choices=(1, 2),
        help="the eureka round whose prompt is timed (2: with the previous best reply and its reflection)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-speeds", action="store_true", help="skip the tokens/s measurements")
    parser.add_argument("--quick", action="store_true", help="round 1, 4 samples x 32 tokens, 1 repeat, before/after")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per worker process")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker_speeds(args) if args.worker == "speeds" else worker_round(args)
        print(json.dumps(result))
        return 0
    if args.quick:
        args.samples, args.reply_tokens, args.repeats, args.arms, args.round = 4, 32, 1, "before,after", 1
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    reason = f"{args.threads} thread(s) as given"
    if args.threads <= 0:
        args.threads, reason = choose_threads()
    out: dict[str, Any] = {
        "model": "embedded/qwen2.5-coder-1.5b-instruct",
        "cores": os.cpu_count(),
        "threads": args.threads,
        "threads_chosen": reason,
        "load_avg_start": load_avg(),
        "samples": args.samples,
        "reply_tokens": args.reply_tokens,
        "round": args.round,
        "repeats": args.repeats,
        "arms": arms,
    }
    print(f"llm_throughput: {json.dumps(out)}", file=sys.stderr, flush=True)
    if not args.no_speeds:
        out.update(spawn("speeds", args))
    rounds = []
    for rep in range(args.repeats):
        for arm in arms if rep % 2 == 0 else arms[::-1]:  # ABC CBA: drift in the load hits both sides
            rounds.append({"repeat": rep, **spawn(arm, args)})
    out["rounds"] = rounds
    means = {arm: statistics.mean(r["wall_s"] for r in rounds if r["arm"] == arm) for arm in arms}
    for arm, mean in means.items():
        out[f"round_time_{arm}_s"] = round(mean, 2)
    if "before" in means and "after" in means:
        out["round_time_ratio"] = round(means["after"] / means["before"], 3)
        out["round_time_ratio_per_repeat"] = [
            round(a["wall_s"] / b["wall_s"], 3)
            for rep in range(args.repeats)
            for a in rounds
            if a["repeat"] == rep and a["arm"] == "after"
            for b in rounds
            if b["repeat"] == rep and b["arm"] == "before"
        ]
    if "one_slot" in means and "after" in means:
        out["round_time_ratio_one_slot"] = round(means["after"] / means["one_slot"], 3)
    if "slots8" in means and "before" in means:
        out["round_time_ratio_slots8"] = round(means["slots8"] / means["before"], 3)
    for arm in arms:  # CPU time is steadier than wall time on a shared machine
        out[f"round_cpu_{arm}_s"] = round(statistics.mean(r["cpu_s"] for r in rounds if r["arm"] == arm), 2)
    out["load_avg_end"] = load_avg()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
