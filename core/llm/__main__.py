"""Ask the configured model from the command line.

    python -m core.llm "Write a Python function that returns 1"
    python -m core.llm "Explain PPO in one line" llm=openai llm.model=gpt-4o
    python -m core.llm "..." llm.n_threads=2 llm.max_tokens=64 --n 4

Extra arguments are Hydra overrides of the ``llm`` group; the reply goes to stdout and
a one-line stats summary to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omegaconf import DictConfig

from core.llm.client import make_client
from core.llm.errors import LLMError


def compose_llm(overrides: Sequence[str] = ()) -> DictConfig:
    """The ``llm`` node composed from ``conf/llm/`` with Hydra ``overrides``.

    ``llm=<name>`` picks the backend file (default ``embedded``); ``llm.<key>=<value>``
    changes one setting.
    """
    from hydra import compose, initialize_config_dir

    from core.resources import conf_dir

    rewritten = []
    chosen = False
    for item in overrides:
        # Only the llm group is composed (no primary config), so the group choice is
        # an addition ("+llm=x") rather than an override of a defaults-list entry.
        if item.split("=", 1)[0].lstrip("+~") == "llm":
            chosen = True
            item = "+" + item.lstrip("+")
        rewritten.append(item)
    if not chosen:
        rewritten.insert(0, "+llm=embedded")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name=None, overrides=rewritten)
    return cfg.llm


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m core.llm``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m core.llm", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. llm=openai llm.max_tokens=64")
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument("--n", type=int, default=1, help="number of samples to print")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed -> cached replies)")
    args = parser.parse_intermixed_args(argv)

    try:
        cfg = compose_llm(args.overrides)
    except Exception as exc:  # Hydra's own messages name the bad override
        print(f"error: bad llm overrides: {exc}", file=sys.stderr)
        return 2
    from core import interrupts

    interrupts.install()
    try:
        client = make_client(cfg)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        replies = client.chat(messages, n=args.n, seed=args.seed, tag="cli")
    except LLMError as exc:  # a user error, as in `python -m core`: the same exit status
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        interrupts.leave(130)
    for i, reply in enumerate(replies):
        if args.n > 1:
            print(f"--- sample {i} ---")
        print(reply.text)
    s = client.stats
    speed = f", {s.completion_tokens / s.wait_s:.1f} tokens/s" if s.wait_s > 0 else ""
    from core.llm import embedded

    loaded = embedded.loaded_info()
    load = f", model load {loaded['load_s']:.1f} s ({loaded['plan']})" if loaded else ""
    print(f"[{client.model}] {s.summary()}{speed}{load}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
