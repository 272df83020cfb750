"""Named hostile and broken programs for the sandbox tests, one per failure mode.

Each constant is the source an LLM might write; the tests say which report ``kind``
it must produce. ``CartPoleTask`` is a minimal task so these tests do not depend on
the task catalogue.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from core.envs.task import StateField, Task

# -- fine programs ---------------------------------------------------------------------
REWARD_OK = """
import math
import torch
from torch import nn
import torch.nn.functional as F
import numpy as np

TEMPERATURE = 0.5

def _upright(angle):
    return torch.exp(-angle.abs() / TEMPERATURE)

def compute_reward(state, action, next_state):
    upright = _upright(next_state["pole_angle"])
    centered = -0.1 * F.relu(next_state["cart_position"].abs() - 1.0)
    speed = -0.01 * torch.as_tensor(np.square(next_state["pole_angular_velocity"].numpy()))
    reward = upright + centered + speed * math.cos(0.0)
    return reward, {"upright": upright, "centered": centered}
"""
REWARD_PLAIN_TENSOR = """
def compute_reward(state, action, next_state):
    return 1.0 - next_state["pole_angle"].abs()
"""
STATE_OK = """
import torch
def revise_state(state):
    angle = state["pole_angle"]
    return torch.stack([torch.sin(angle), torch.cos(angle), state["cart_position"] ** 2], dim=-1)
"""
STATE_ONE_FEATURE = """
def revise_state(state):
    return state["pole_angle"] * state["pole_angular_velocity"]
"""
TYPE_HINTS_OK = """
from typing import Dict, Tuple
import torch

def compute_reward(state: Dict[str, torch.Tensor], action: torch.Tensor,
                   next_state: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    upright: torch.Tensor = 1.0 - next_state["pole_angle"].abs()
    return upright, {"upright": upright}
"""

# -- escapes: rejected by the static check ("forbidden") ---------------------------------------
IMPORT_OS = "import os\ndef compute_reward(s, a, n):\n    os.system('true')\n    return s['pole_angle']"
IMPORT_SOCKET = "import socket\ndef compute_reward(s, a, n):\n    return socket.socket()"
IMPORT_SUBPROCESS = "import subprocess\ndef compute_reward(s, a, n):\n    subprocess.run(['ls'])"
IMPORT_CTYPES = "import ctypes\ndef compute_reward(s, a, n):\n    return ctypes.CDLL(None)"
FROM_OS_IMPORT = "from os import system\ndef compute_reward(s, a, n):\n    system('true')"
IMPORT_INSIDE_FUNCTION = "def compute_reward(s, a, n):\n    import shutil\n    shutil.rmtree('/')"
FORK_BOMB_OS = "import os\ndef compute_reward(s, a, n):\n    while True:\n        os.fork()"
FORK_BOMB_MULTIPROCESSING = (
    "import multiprocessing\ndef compute_reward(s, a, n):\n"
    "    while True:\n        multiprocessing.Process(target=compute_reward, args=(s, a, n)).start()"
)
TORCH_MULTIPROCESSING = (
    "import torch\ndef compute_reward(s, a, n):\n    torch.multiprocessing.Process(target=print).start()"
)
OPEN_PASSWD = "def compute_reward(s, a, n):\n    return open('/etc/passwd').read()"
DUNDER_IMPORT = "def compute_reward(s, a, n):\n    __import__('os').system('true')"
SUBCLASSES_WALK = (
    "def compute_reward(s, a, n):\n"
    "    for c in ().__class__.__base__.__subclasses__():\n"
    "        if c.__name__ == 'Popen':\n            c(['true'])"
)
GETATTR_BUILTINS = "def compute_reward(s, a, n):\n    return getattr(__builtins__, 'open')('/etc/passwd')"
GENERATOR_FRAME_ESCAPE = (
    "def compute_reward(s, a, n):\n    g = (x for x in [1])\n    return g.gi_frame.f_globals['__builtins__']"
)
LAMBDA_GLOBALS = "def compute_reward(s, a, n):\n    f = lambda: 0\n    return f.__globals__"
FORMAT_STRING_ESCAPE = "def compute_reward(s, a, n):\n    return '{0.__class__.__mro__}'.format(s)"
EXEC_STRING = "def compute_reward(s, a, n):\n    exec('import os')"
EVAL_STRING = "def compute_reward(s, a, n):\n    return eval('s[\"pole_angle\"]')"
COMPILE_STRING = "def compute_reward(s, a, n):\n    return compile('1', 'x', 'eval')"
GLOBALS_CALL = "def compute_reward(s, a, n):\n    return globals()"
TORCH_LOAD = "import torch\ndef compute_reward(s, a, n):\n    return torch.load('/tmp/evil.pt')"
TORCH_SAVE = "import torch\ndef compute_reward(s, a, n):\n    torch.save(s, '/tmp/x.pt')"
NP_LOAD = "import numpy as np\ndef compute_reward(s, a, n):\n    return np.load('/etc/passwd')"
NP_FROMFILE = "import numpy as np\ndef compute_reward(s, a, n):\n    return np.fromfile('/etc/passwd')"
NUMPY_OS = "import numpy\ndef compute_reward(s, a, n):\n    numpy.os.system('true')"
TORCH_OPS = "import torch\ndef compute_reward(s, a, n):\n    return torch.ops.aten.add(1, 2)"
TORCH_UTILS = "from torch.utils import data\ndef compute_reward(s, a, n):\n    return data"
TORCH_HUB = "import torch\ndef compute_reward(s, a, n):\n    return torch.hub.load('x', 'y')"
NUMPY_CTYPESLIB = "import numpy as np\ndef compute_reward(s, a, n):\n    return np.ctypeslib.load_library('x', '.')"
TORCH_PRIVATE = "import torch\ndef compute_reward(s, a, n):\n    return torch._C"
MODULE_AS_VALUE = "import torch\ndef compute_reward(s, a, n):\n    t = torch\n    return t.sys"
MODULE_VIA_SUBMODULE = "import torch.nn.functional as F\ndef compute_reward(s, a, n):\n    return F.torch.random"
TENSOR_STORAGE = "def compute_reward(s, a, n):\n    return s['pole_angle'].untyped_storage()"
SEED_GLOBAL_RNG = "import torch\ndef compute_reward(s, a, n):\n    torch.manual_seed(0)\n    return s['pole_angle']"
SET_THREADS = "import torch\ndef compute_reward(s, a, n):\n    torch.set_num_threads(64)\n    return s['pole_angle']"
HUGE_ALLOC_TORCH = "import torch\ndef compute_reward(s, a, n):\n    return torch.zeros(10**11)"
HUGE_ALLOC_LIST = "def compute_reward(s, a, n):\n    x = [0] * 10**10\n    return s['pole_angle']"
HUGE_ALLOC_2D = (
    "import torch\ndef compute_reward(s, a, n):\n    return torch.zeros(100000, 100000).sum() + s['pole_angle']"
)
BARE_EXCEPT_SWALLOW = (
    "def compute_reward(s, a, n):\n    while True:\n        try:\n            pass\n        except:\n            pass"
)
FINALLY_OUTLIVES = (
    "def compute_reward(s, a, n):\n    try:\n        pass\n    finally:\n        while True:\n            pass"
)
CLASS_DEF = (
    "class R:\n    def __exit__(self, *a):\n        return True\n"
    "def compute_reward(s, a, n):\n    return s['pole_angle']"
)
GLOBAL_STATEMENT = "X = 0\ndef compute_reward(s, a, n):\n    global X\n    X += 1\n    return s['pole_angle']"
STAR_IMPORT = "from torch import *\ndef compute_reward(s, a, n):\n    return s['pole_angle']"
TYPE_MRO = "def compute_reward(s, a, n):\n    return type(s).mro()"
ASYNC_DEF = "async def compute_reward(s, a, n):\n    return s['pole_angle']"

#: name -> source; every one must be reported as ``forbidden`` without running.
FORBIDDEN = {
    name: value
    for name, value in dict(globals()).items()
    if name.isupper()
    and isinstance(value, str)
    and name not in {"REWARD_OK", "REWARD_PLAIN_TENSOR", "STATE_OK", "STATE_ONE_FEATURE", "TYPE_HINTS_OK"}
}

# -- broken programs: parse and pass the check, fail when run --------------------------------
SYNTAX_ERROR = "def compute_reward(s, a, n):\n    return s['pole_angle'] +"
WRONG_SIGNATURE = "def compute_reward(state):\n    return state['pole_angle']"
MISSING_ENTRY = "def reward(s, a, n):\n    return s['pole_angle']"
INFINITE_LOOP = "def compute_reward(s, a, n):\n    while True:\n        pass"
MODULE_LEVEL_LOOP = "while True:\n    pass\ndef compute_reward(s, a, n):\n    return s['pole_angle']"
SLOW_CODE = (
    "def compute_reward(s, a, n):\n    total = 0\n    k = 10000\n    for i in range(k * k):\n"
    "        total += i\n    return s['pole_angle'] * 0 + total"
)
RECURSION_BOMB = "def compute_reward(s, a, n):\n    return compute_reward(s, a, n)"
RUNTIME_ALLOC = (
    "import torch\ndef compute_reward(s, a, n):\n    k = 40000\n    big = torch.ones(k, k)\n"
    "    return big.sum() + s['pole_angle']"
)
RUNTIME_LIST_ALLOC = "def compute_reward(s, a, n):\n    k = 100000\n    x = [1.5] * (k * k)\n    return s['pole_angle']"
RAISES_KEYERROR = "def compute_reward(s, a, n):\n    key = 'pole_' + 'velocity'\n    v = s[key]\n    return v"
RAISES_ZERODIVISION = "def compute_reward(s, a, n):\n    scale = 1 / 0\n    return s['pole_angle'] * scale"
RETURNS_NAN = "import torch\ndef compute_reward(s, a, n):\n    return torch.log(-1.0 - s['pole_angle'].abs())"
RETURNS_INF = "def compute_reward(s, a, n):\n    return s['pole_angle'] * float('inf')"
NAN_COMPONENT = (
    "import math\ndef compute_reward(s, a, n):\n    r = s['pole_angle']\n    return r, {'bad': r * math.nan}"
)
WRONG_SHAPE = (
    "import torch\ndef compute_reward(s, a, n):\n    return torch.stack([s['pole_angle'], s['cart_position']], dim=-1)"
)
SCALAR_REWARD = "def compute_reward(s, a, n):\n    return float(s['pole_angle'].mean())"
WRONG_DTYPE = "def compute_reward(s, a, n):\n    return (s['pole_angle'] > 0).long()"
RETURNS_NONE = "def compute_reward(s, a, n):\n    x = s['pole_angle']"
STDOUT_FLOOD = "def compute_reward(s, a, n):\n    while True:\n        print('spam ' * 100)"
MUTATES_INPUT = (
    "def compute_reward(s, a, n):\n    s['pole_angle'].mul_(0)\n    n['pole_angle'].add_(100)\n    return a.float() * 0"
)
RETURNS_COMPLEX = "def compute_reward(s, a, n):\n    return n['pole_angle'] * (1 + 2j)"
#: fine on the probe's call, then never returns
SLOW_AFTER_PROBE = """
CALLS = [0]

def compute_reward(s, a, n):
    CALLS[0] += 1
    if CALLS[0] > 1:
        while True:
            pass
    return n["pole_angle"]
"""
#: correct, but a few milliseconds of Python per call
SLOW_CALLS = """
def compute_reward(s, a, n):
    total = 0.0
    for i in range(300000):
        total += i * 1e-12
    return n["pole_angle"] * 0.0 + total
"""
#: keeps what it returned and fills it with NaN on the next call
KEEPS_ITS_RESULT = """
KEPT = []

def compute_reward(s, a, n):
    for old in KEPT:
        old.fill_(float("nan"))
    reward = n["pole_angle"] * 0.0 + 1.0
    KEPT.append(reward)
    return reward
"""

# -- bypass programs: run only with the test-only `_skip_check=True` ------------------------
#: Tries to hold 20 processes at once; must be stopped by RLIMIT_NPROC.
BYPASS_FORK_20 = """
import os, time
def compute_reward(s, a, n):
    made = 0
    errors = 0
    for _ in range(20):
        try:
            pid = os.fork()
        except OSError:
            errors += 1
            continue
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    raise RuntimeError(f"made={made} errors={errors}")
"""
BYPASS_FORK_BOMB = """
import os
def compute_reward(s, a, n):
    while True:
        try:
            os.fork()
        except OSError:
            pass
"""
BYPASS_MULTIPROCESSING_BOMB = """
import multiprocessing, time
def _spin():
    while True:
        pass
def compute_reward(s, a, n):
    started = 0
    for _ in range(50):
        try:
            multiprocessing.get_context("fork").Process(target=_spin).start()
            started += 1
        except Exception as e:
            raise RuntimeError(f"started={started} stopped_by={type(e).__name__}")
    raise RuntimeError(f"started={started}")
"""
BYPASS_WHOAMI = (
    "import os\ndef compute_reward(s, a, n):\n    raise RuntimeError(f'uid={os.getuid()} euid={os.geteuid()}')"
)
BYPASS_WRITE_FILE = """
def compute_reward(s, a, n):
    with open("/tmp/llm4rl-sandbox-probe.txt", "w") as f:
        f.write("x" * 1000)
        f.flush()
    raise RuntimeError("wrote")
"""
BYPASS_MEMORY = "def compute_reward(s, a, n):\n    x = bytearray(3 * 1024 ** 3)\n    return x"
BYPASS_ENVIRON = """
import os
def compute_reward(s, a, n):
    raise RuntimeError(f"keys={sorted(os.environ)} key={os.environ.get('LLM4RL_TEST_API_KEY')}")
"""
BYPASS_NETWORK = """
import socket
def compute_reward(s, a, n):
    socket.create_connection(("1.1.1.1", 53), timeout=0.5)
    return n["pole_angle"]
"""
#: fine on the probe's call, then crashes the interpreter
BYPASS_CRASH_AFTER_PROBE = """
import ctypes
CALLS = [0]
def compute_reward(s, a, n):
    CALLS[0] += 1
    if CALLS[0] > 1:
        ctypes.string_at(0)
    return n["pole_angle"]
"""


class CartPoleTask(Task):
    """A minimal CartPole-v1 task with the four named state fields."""

    def __init__(self) -> None:
        super().__init__(
            name="cartpole",
            goal="Keep the pole upright.",
            state_fields=[
                StateField("cart_position", 0, 1, "cart position", "m"),
                StateField("cart_velocity", 1, 2, "cart velocity", "m/s"),
                StateField("pole_angle", 2, 3, "pole angle", "rad"),
                StateField("pole_angular_velocity", 3, 4, "pole angular velocity", "rad/s"),
            ],
            description="CartPole-v1",
        )

    def make_env(self, num_envs: int, seed: int, params: dict[str, Any] | None = None) -> gymnasium.vector.VectorEnv:
        return gymnasium.make_vec(
            "CartPole-v1",
            num_envs,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP},
        )
