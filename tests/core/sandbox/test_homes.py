"""Home folders stay hidden when the interpreter lives inside one (a virtual environment under ``~/.cache``).

The worker binds back only the interpreter's own folders, read-only: a program sees the
names on the way to them and nothing else of the home (not the LLM cache beside them,
not another tool's token).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from test_hostile_corpus import workers_isolated

REPO = Path(__file__).resolve().parents[3]
#: run by the interpreter of a virtual environment under /root/.cache: what a worker sees of the home
LOOK = """
import json, sys
from core.records import RewardProgram
from core.sandbox import Limits, ProgramWorker, SandboxError, candidate_scope, prepare_reward
from core.envs.classic import CartPole
import torch

source = '''
import os
import sys

def compute_reward(state, action, next_state):
    seen = {}
    for top in ('/root', '/root/.cache', os.path.dirname(sys.prefix)):
        seen[top] = sorted(os.listdir(top)) if os.path.isdir(top) else None
    try:
        seen['token'] = open(TOKEN).read()
    except OSError as e:
        seen['token'] = type(e).__name__
    try:
        open(os.path.join(sys.prefix, 'planted'), 'w').write('x')
        seen['write'] = 'written'
    except OSError as e:
        seen['write'] = type(e).__name__
    raise RuntimeError('SEEN' + json.dumps(seen) + 'END')
'''.replace('TOKEN', repr(sys.argv[1])).replace('import sys', 'import sys\\nimport json')
limits = Limits(static_check=False)
task = CartPole()
with candidate_scope():
    worker = ProgramWorker(limits)
    try:
        fn = prepare_reward(RewardProgram(source), task, limits=limits, worker=worker)
        fn.from_obs(torch.zeros(4, task.obs_dim), torch.zeros(4, dtype=torch.long), torch.zeros(4, task.obs_dim))
    except SandboxError as e:
        text = e.report.message + e.report.detail
        print(json.dumps({"prefix": sys.prefix, "iso": worker.isolation,
                          "seen": json.loads('{' + text.split('SEEN{', 1)[1].split('}END', 1)[0] + '}')}))
"""


@pytest.fixture
def home_venv() -> tuple[Path, Path]:
    """A virtual environment under /root/.cache that imports this checkout's packages, and a token beside it."""
    if not os.access("/root", os.W_OK) or not workers_isolated():
        pytest.skip("needs root (a home to put the environment in) and isolated workers")
    base = Path(f"/root/.cache/llm4rl-test-home-{os.getpid()}")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True)
    site = next((base / "venv" / "lib").glob("python3*")) / "site-packages"
    (site / "checkout.pth").write_text(f"{REPO}\n{sysconfig.get_paths()['purelib']}\n")
    token = base / "other-tool-token"
    token.write_text("a token of another tool")
    token.chmod(0o644)
    try:
        yield base, token
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_venv_under_a_home_shows_only_its_own_path(home_venv: tuple[Path, Path]) -> None:
    base, token = home_venv
    out = subprocess.run(
        [str(base / "venv" / "bin" / "python"), "-c", LOOK, str(token)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["prefix"].startswith(str(base)), found["prefix"]  # the worker really runs from the home
    assert "/root" in found["iso"]["hidden"], found["iso"]
    seen = found["seen"]
    assert seen["/root"] == [".cache", ".pyenv"] or seen["/root"] == [".cache"], seen  # the way to the interpreters
    assert seen["/root/.cache"] == [base.name], seen  # not the LLM cache or any other tool's folder
    assert seen[str(base)] == ["venv"], seen  # the token beside the environment is not there
    assert seen["token"] == "FileNotFoundError", seen
    assert seen["write"] in ("OSError", "PermissionError"), seen  # the environment is bound back read-only
