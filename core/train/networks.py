"""Actor and critic networks, their lean TorchRL wrappers, and a lean collection policy.

The actor and the critic are separate MLPs (tanh, orthogonal init: the usual PPO
choice). ``ClipPPOLoss`` runs them through :class:`LossActor` and :class:`LossCritic`:
minimal ``TensorDictModuleBase`` modules (one key in, one key out) whose ``get_dist``
returns a small distribution (:class:`LightCategorical`, :class:`LightNormal`) computing
``log_prob`` and ``entropy`` straight from the network output. That skips
``ProbabilisticActor``'s parameter-TensorDict plumbing and ``torch.distributions``'
argument checks and broadcasting, which were most of the loss's time on small MLPs.
Collection runs :class:`SamplingPolicy`, one plain ``nn.Module`` that samples an action
and its log-probability with the same formulas.

The PPO update runs :class:`FlatActorCritic`: both networks' parameters live in one
flat tensor (the modules' parameters are views of it, so collection, evaluation and
saving see every update), both networks' activations share buffers, and the backward
pass is written out by hand into a flat gradient; :class:`FlatAdam` steps the flat
tensor with Adam's fused kernel. On the small MLPs of classic control a PPO minibatch
is a few dozen tiny kernels, and autograd's graph building, ``nn.Module`` calls,
per-tensor gradient clipping and the ``Optimizer`` machinery cost more than the
arithmetic; here one minibatch step is ~50 kernel calls and no Python beyond them.

SAC's update runs :class:`FlatSAC` the same way: the actor's, the twin critics' and the
target critics' parameters in flat tensors (TorchRL's modules keep views of them), the
backward pass written out, :class:`FlatParamsAdam` (fused Adam with ``torch.optim``'s
interface) and the action head :class:`SquashedGaussian` (TorchRL's ``TanhNormal``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.nn import functional as F
from torchrl.data import Categorical as CategoricalSpec, TensorSpec

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
_LOG_2 = math.log(2.0)


def mlp(n_in: int, hidden: list[int], n_out: int, out_std: float) -> nn.Sequential:
    """Tanh MLP with orthogonal weights (gain sqrt(2), last layer ``out_std``)."""
    layers: list[nn.Module] = []
    sizes = [n_in, *hidden]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [_linear(a, b, 2**0.5), nn.Tanh()]
    layers.append(_linear(sizes[-1], n_out, out_std))
    return nn.Sequential(*layers)


def _linear(n_in: int, n_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class GaussianHead(nn.Module):
    """Mean from an MLP, a state-independent log standard deviation."""

    def __init__(self, net: nn.Module, action_dim: int) -> None:
        super().__init__()
        self.net = net
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc = self.net(obs)
        return loc, self.log_std.exp().expand_as(loc)


class SamplingPolicy(nn.Module):
    """Collection policy: writes ``action`` and its log-probability into the tensordict.

    Categorical: ``log_softmax``, then ``argmax(p / E)`` with ``E`` i.i.d. exponential
    (the exponential-race form of the Gumbel-max trick: an exact sample, since
    ``E_k / p_k ~ Exp(p_k)`` and the smallest of independent exponentials is ``k`` with
    probability proportional to ``p_k``), a fraction of ``multinomial``'s cost on small
    batches; Gaussian: ``loc + std * noise`` with the summed normal log-density (what
    ``IndependentNormal`` computes).

    :param actor: ``obs -> logits`` or ``obs -> (loc, std)``: the actor network, or
        :meth:`FlatActorCritic.actor`.
    """

    def __init__(self, actor: Callable[[torch.Tensor], Any], discrete: bool, log_prob_key: str) -> None:
        super().__init__()
        self.actor = actor
        self.discrete = discrete
        self.log_prob_key = log_prob_key

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        obs = td.get("observation")
        if self.discrete:
            logp = torch.log_softmax(self.actor(obs), dim=-1)
            action = (logp.exp() / torch.empty_like(logp).exponential_()).argmax(-1, keepdim=True)
            td.set("action", action.squeeze(-1))
            td.set(self.log_prob_key, logp.gather(-1, action).squeeze(-1))
        else:
            loc, std = self.actor(obs)
            noise = torch.randn_like(loc)
            td.set("action", loc + std * noise)
            log_prob = -0.5 * noise.pow(2) - std.log() - _HALF_LOG_2PI
            td.set(self.log_prob_key, log_prob.sum(-1))
        return td


class LightCategorical:
    """Categorical over the last dim of ``logits``: ``log_prob`` and ``entropy`` only."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logp = torch.log_softmax(logits, dim=-1)

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        return self.logp.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        return -(self.logp.exp() * self.logp).sum(-1)


class LightNormal:
    """Diagonal Gaussian, densities summed over the last dim (``IndependentNormal``)."""

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor) -> None:
        self.loc, self.scale = loc, scale

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        z = (action - self.loc) / self.scale
        return (-0.5 * z.pow(2) - self.scale.log() - _HALF_LOG_2PI).sum(-1)

    def entropy(self) -> torch.Tensor:
        return (0.5 + _HALF_LOG_2PI + self.scale.log()).sum(-1)


class LossActor(TensorDictModuleBase):
    """The actor as ``ClipPPOLoss`` sees it: ``observation`` -> a light distribution.

    ``forward`` samples (``action`` and its log-probability), like the collection policy.
    """

    def __init__(self, actor_net: nn.Module, discrete: bool, log_prob_key: str = "action_log_prob") -> None:
        super().__init__()
        self.actor_net, self.discrete = actor_net, discrete
        self.in_keys = ["observation"]
        self.out_keys = ["action"]
        self._sampler = SamplingPolicy(actor_net, discrete, log_prob_key)

    def get_dist(self, tensordict: TensorDictBase) -> LightCategorical | LightNormal:
        out = self.actor_net(tensordict.get("observation"))
        return LightCategorical(out) if self.discrete else LightNormal(*out)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._sampler(tensordict)


class LossCritic(TensorDictModuleBase):
    """The critic as ``ClipPPOLoss`` and ``GAE`` see it: ``observation`` -> ``state_value``."""

    def __init__(self, critic_net: nn.Module) -> None:
        super().__init__()
        self.critic_net = critic_net
        self.in_keys = ["observation"]
        self.out_keys = ["state_value"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tensordict.set("state_value", self.critic_net(tensordict.get("observation")))
        return tensordict


@dataclass
class Networks:
    """Everything built from one actor net and one critic net."""

    actor: LossActor  # for ClipPPOLoss: get_dist(td)
    critic: LossCritic  # writes "state_value"
    actor_net: nn.Module
    critic_net: nn.Module
    discrete: bool

    def parameters(self) -> list[nn.Parameter]:
        return [*self.actor_net.parameters(), *self.critic_net.parameters()]

    def sampling_policy(self, log_prob_key: str) -> SamplingPolicy:
        return SamplingPolicy(self.actor_net, self.discrete, log_prob_key)

    @torch.no_grad()
    def entropy(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy's entropy at each observation ``[B]``."""
        out = self.actor_net(obs)
        return (LightCategorical(out) if self.discrete else LightNormal(*out)).entropy()

    @torch.no_grad()
    def act_deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """Greedy action (argmax, or the Gaussian mean) for evaluation."""
        if self.discrete:
            return self.actor_net(obs).argmax(-1)
        return self.actor_net(obs)[0]

    @torch.no_grad()
    def act_sampled(self, obs: torch.Tensor) -> torch.Tensor:
        """An action sampled from the policy (evaluation of stochastic behaviour)."""
        if self.discrete:
            return torch.multinomial(torch.softmax(self.actor_net(obs), dim=-1), 1).squeeze(-1)
        loc, std = self.actor_net(obs)
        return loc + std * torch.randn_like(loc)


def build_networks(obs_dim: int, action_spec: TensorSpec, hidden: list[int]) -> Networks:
    """Actor and critic for ``obs_dim`` inputs and a Categorical or Bounded action spec."""
    critic_net = mlp(obs_dim, hidden, 1, 1.0)
    if isinstance(action_spec, CategoricalSpec):
        actor_net: nn.Module = mlp(obs_dim, hidden, int(action_spec.n), 0.01)
        discrete = True
    else:
        action_dim = int(action_spec.shape[-1])
        actor_net = GaussianHead(mlp(obs_dim, hidden, action_dim, 0.01), action_dim)
        discrete = False
    return Networks(LossActor(actor_net, discrete), LossCritic(critic_net), actor_net, critic_net, discrete)


def _linears(net: nn.Module) -> list[nn.Linear]:
    return [m for m in net.modules() if isinstance(m, nn.Linear)]


class FlatActorCritic:
    """Actor and critic parameters in one flat tensor, with a fused forward and a hand-written backward.

    Layout of :attr:`params` (and of the gradient :attr:`grad`): per hidden layer the
    actor's and the critic's weights (a ``[2, out, in]`` block) then their biases
    (``[2, out]``); then the actor's head, the critic's head and, for Gaussian policies,
    ``log_std``. The modules' parameters become views of :attr:`params`, so that an
    optimizer step on it is seen by the collection policy, evaluation and ``state_dict``.

    Both networks' hidden activations of a layer share one ``[2, N, out]`` buffer, so
    that the activation and its backward are one kernel for both. For a hidden layer
    ``h' = tanh(z)``, ``z = h W^T + b``, the backward pass is ``dz = dh' (1 - h'^2)``,
    ``dW = dz^T h``, ``db = sum_rows dz``, ``dh = dz W``. ``tanh`` is computed as
    ``2 sigmoid(2 z) - 1`` (the same function; PyTorch's CPU sigmoid is several times
    faster than its tanh), with the factor 2 folded into the matmul.

    :param actor_net: an MLP (``nn.Sequential`` of Linear/Tanh) or a :class:`GaussianHead` around one.
    :param critic_net: an MLP with the actor's input and hidden sizes and one output.
    """

    def __init__(self, actor_net: nn.Module, critic_net: nn.Module) -> None:
        self.gaussian = isinstance(actor_net, GaussianHead)
        actor, critic = _linears(actor_net), _linears(critic_net)
        if len(actor) < 2 or [(m.in_features, m.out_features) for m in actor[:-1]] != [
            (m.in_features, m.out_features) for m in critic[:-1]
        ]:
            raise ValueError("actor and critic need the same input and hidden sizes (at least one hidden layer)")
        shapes: list[tuple[int, ...]] = []  # in layout order
        for a in actor[:-1]:
            shapes += [(2, a.out_features, a.in_features), (2, a.out_features)]
        for head in (actor[-1], critic[-1]):
            shapes += [tuple(head.weight.shape), tuple(head.bias.shape)]
        if self.gaussian:
            shapes.append(tuple(actor_net.log_std.shape))  # type: ignore[arg-type]
        first = actor[0].weight
        self.params = torch.zeros(sum(math.prod(s) for s in shapes), dtype=first.dtype, device=first.device)
        self.grad = torch.zeros_like(self.params)
        self.params.grad = self.grad  # the optimizer reads it; backward() overwrites it in place
        views, grads, at = [], [], 0
        for shape in shapes:
            views.append(self.params[at : at + math.prod(shape)].view(shape))
            grads.append(self.grad[at : at + math.prod(shape)].view(shape))
            at += math.prod(shape)
        depth = len(actor) - 1
        weights, biases, grad_biases = views[0 : 2 * depth : 2], views[1 : 2 * depth : 2], grads[1 : 2 * depth : 2]
        # per hidden layer, per network (0: actor, 1: critic): weight, weight^T, bias, weight gradient
        self._hidden = [
            [(weights[i][j], weights[i][j].t(), biases[i][j], grads[2 * i][j]) for j in (0, 1)] for i in range(depth)
        ]
        self._grad_biases = grad_biases  # [2, out] per hidden layer: one row sum fills both
        # the heads (0: actor logits or mean, 1: value): weight, weight^T, bias, their gradients
        at = 2 * depth
        self._heads = [
            (views[at + k], views[at + k].t(), views[at + k + 1], grads[at + k], grads[at + k + 1]) for k in (0, 2)
        ]
        # read only when gaussian
        self.log_std: torch.Tensor = views[-1] if self.gaussian else None  # type: ignore[assignment]
        self.grad_log_std: torch.Tensor = grads[-1] if self.gaussian else None  # type: ignore[assignment]
        self._workspaces: dict[int, _Workspace] = {}
        self._last: _Workspace | None = None
        with torch.no_grad():  # the initial values in, then the modules' parameters become views
            pairs = []
            for i, layers in enumerate(zip(actor[:-1], critic[:-1])):
                pairs += [(m, weights[i][j], biases[i][j]) for j, m in enumerate(layers)]
            pairs += [(actor[-1], *views[at : at + 2]), (critic[-1], *views[at + 2 : at + 4])]  # type: ignore[list-item]
            for layer, w, b in pairs:
                w.copy_(layer.weight), b.copy_(layer.bias)
                layer.weight, layer.bias = nn.Parameter(w), nn.Parameter(b)
            if self.gaussian:
                self.log_std.copy_(actor_net.log_std)  # type: ignore[arg-type]
                actor_net.log_std = nn.Parameter(self.log_std)

    def actor(self, obs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The actor's output as ``actor_net`` gives it (logits, or ``(loc, std)``), for collection."""
        out = self._net(obs, 0)
        return (out, self.log_std.exp().expand_as(out)) if self.gaussian else out

    def critic(self, obs: torch.Tensor) -> torch.Tensor:
        """The critic's values ``[N, 1]`` (for advantages)."""
        return self._net(obs, 1)

    def _net(self, obs: torch.Tensor, j: int) -> torch.Tensor:
        """Network ``j`` (0: actor, 1: critic) alone, without buffers."""
        x = obs
        for layer in self._hidden:
            _, wt, b, _ = layer[j]
            if x.shape[0] * wt.shape[1] < 4096:  # a few rows: one tanh kernel beats three cheaper ones
                x = torch.addmm(b, x, wt).tanh_()
            else:
                x = torch.addmm(b, x, wt, beta=2.0, alpha=2.0).sigmoid_().mul_(2.0).sub_(1.0)
        _, wt, b, _, _ = self._heads[j]
        return torch.addmm(b, x, wt)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(actor head [N, A], value [N, 1])`` for ``obs [N, D]``, without autograd.

        The actor head is the logits (categorical) or the mean (Gaussian). Results live
        in buffers that the next call with the same ``N`` overwrites; the activations
        stay for :meth:`backward`.
        """
        ws = self._workspace(obs.shape[0])
        ws.obs = obs
        x: tuple[torch.Tensor, ...] = (obs, obs)
        for layer, out, halves in zip(self._hidden, ws.acts, ws.act_halves):
            for (_, wt, b, _), xj, oj in zip(layer, x, halves):
                torch.addmm(b, xj, wt, beta=2.0, alpha=2.0, out=oj)  # 2 z
            torch.sigmoid(out, out=out).mul_(2.0).sub_(1.0)  # tanh(z)
            x = halves
        for (_, wt, b, _, _), xj, oj in zip(self._heads, x, ws.outputs):
            torch.addmm(b, xj, wt, out=oj)
        self._last = ws
        return ws.outputs

    def backward(self, d_head: torch.Tensor, d_value: torch.Tensor) -> None:
        """Write the gradient of the loss into :attr:`grad`, given its derivatives by the
        outputs of the last :meth:`forward`.

        The ``log_std`` entry of a Gaussian policy is left to the caller (it does not
        depend on the activations).
        """
        ws = self._last
        assert ws is not None, "backward() needs a forward() first"
        heads = zip(self._heads, ws.act_halves[-1], (d_head, d_value), ws.grad_halves[-1])
        for (w, _, _, gw, gb), xj, dj, dhj in heads:
            torch.mm(dj.t(), xj, out=gw)
            torch.sum(dj, 0, out=gb)
            torch.mm(dj, w, out=dhj)
        for i in range(len(self._hidden) - 1, -1, -1):
            dz = ws.grads[i]
            torch.ops.aten.tanh_backward.grad_input(dz, ws.acts[i], grad_input=dz)  # dh (1 - h^2), in place
            torch.sum(dz, 1, out=self._grad_biases[i])
            x = ws.act_halves[i - 1] if i else (ws.obs, ws.obs)
            for (w, _, _, gw), xj, dzj, dxj in zip(  # type: ignore[assignment]
                self._hidden[i], x, ws.grad_halves[i], ws.grad_halves[i - 1] if i else (None, None)
            ):
                torch.mm(dzj.t(), xj, out=gw)
                if dxj is not None:
                    torch.mm(dzj, w, out=dxj)

    def _workspace(self, n: int) -> _Workspace:
        ws = self._workspaces.get(n)
        if ws is None:
            if len(self._workspaces) >= 4:  # a few sizes (minibatch, last partial batch) in practice
                self._workspaces.clear()
            acts = [self.params.new_empty(2, n, layer[0][0].shape[0]) for layer in self._hidden]
            grads = [torch.empty_like(a) for a in acts]
            outputs = (self.params.new_empty(n, self._heads[0][0].shape[0]), self.params.new_empty(n, 1))
            ws = self._workspaces[n] = _Workspace(
                acts, grads, [(a[0], a[1]) for a in acts], [(g[0], g[1]) for g in grads], outputs
            )
        return ws


@dataclass
class _Workspace:
    """Buffers of one minibatch size."""

    acts: list[torch.Tensor]  # [2, N, h] per hidden layer: actor's and critic's activations
    grads: list[torch.Tensor]  # the same shapes: d loss / d activation
    act_halves: list[tuple[torch.Tensor, torch.Tensor]]  # (actor, critic) views of acts
    grad_halves: list[tuple[torch.Tensor, torch.Tensor]]  # (actor, critic) views of grads
    outputs: tuple[torch.Tensor, torch.Tensor]  # actor head [N, A], value [N, 1]
    obs: torch.Tensor | None = None  # the input of the last forward


class FlatAdam:
    """Adam on one flat tensor: ``torch.optim.Adam(fused=True)``'s kernel, called directly.

    The same update as ``torch.optim.Adam([params], fused=True)`` (a test checks that the
    two agree), without the ``Optimizer`` machinery around the kernel (hooks, grouping
    by device and dtype, state lookups), which costs ~90 us a step against ~6 us for the
    kernel on a 10k-parameter MLP pair. Falls back to ``torch.optim.Adam`` where the
    fused kernel is missing.

    :param params: the tensor to optimise; its ``.grad`` is read at each :meth:`step`.
    """

    def __init__(
        self, params: torch.Tensor, lr: float, eps: float = 1e-8, betas: tuple[float, float] = (0.9, 0.999)
    ) -> None:
        self.params, self.lr, self.eps, self.betas = params, float(lr), float(eps), betas
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        self.steps = torch.zeros((), dtype=torch.float32, device=params.device)
        self._fallback = (
            None if hasattr(torch, "_fused_adam_") else torch.optim.Adam([params], lr=lr, eps=eps, betas=betas)
        )

    def step(self) -> None:
        if self._fallback is not None:
            self._fallback.param_groups[0]["lr"] = self.lr
            self._fallback.step()
            return
        self.steps += 1
        torch._fused_adam_(
            [self.params],
            [self.params.grad],  # type: ignore[list-item]
            [self.exp_avg],
            [self.exp_avg_sq],
            [],
            [self.steps],
            amsgrad=False,
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            weight_decay=0.0,
            eps=self.eps,
            maximize=False,
        )


# -- SAC -----------------------------------------------------------------------------------------


class FlatParamsAdam(FlatAdam):
    """:class:`FlatAdam` over modules' parameters that are views of one flat tensor.

    Each parameter's ``.grad`` is made a view of the flat gradient, so that autograd
    accumulates into it in place and one fused Adam call steps them all. Behaves as the
    ``torch.optim.Adam`` it replaces where other code drives it: ``zero_grad`` (the flat
    gradient is zeroed, the views stay), ``step`` (a gradient someone replaced is copied
    back in first), ``state_dict`` / ``load_state_dict`` (the moments and the step count).

    :param flat: the flat tensor the parameters are views of.
    :param params: the parameters, in any order, each a view of ``flat``.
    """

    def __init__(self, flat: torch.Tensor, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(flat, lr)
        flat.grad = torch.zeros_like(flat)
        self.param_list = params
        self._grad_views = []
        for p in params:
            offset = (p.data_ptr() - flat.data_ptr()) // flat.element_size()
            self._grad_views.append(flat.grad[offset : offset + p.numel()].view(p.shape))
        self.attach()

    def attach(self) -> None:
        """Point every parameter's ``.grad`` at its view of the flat gradient."""
        for p, g in zip(self.param_list, self._grad_views):
            p.grad = g

    def zero_grad(self, set_to_none: bool = True) -> None:  # the views stay (the flat gradient is zeroed)
        self.params.grad.zero_()  # type: ignore[union-attr]
        self.attach()

    def step(self) -> None:
        for p, g in zip(self.param_list, self._grad_views):
            if p.grad is not g:  # replaced (set to None, or a fresh tensor): back into the flat gradient
                g.copy_(p.grad) if p.grad is not None else g.zero_()
        self.attach()
        super().step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "steps": self.steps.clone(),
            "lr": self.lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exp_avg.copy_(state["exp_avg"]), self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.steps.copy_(state["steps"])
        self.lr = float(state["lr"])


def flatten_into(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors``' values; each tensor becomes a view of it (``.data``)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    at = 0
    for t in tensors:
        t.data = flat[at : at + t.numel()].view(t.shape)
        at += t.numel()
    return flat


@dataclass
class SquashedGaussian:
    """The actor's output head: ``(loc, raw scale)`` -> a tanh-squashed Gaussian action in bounds.

    ``scale = max(softplus(raw + shift) + min_scale, scale_lb)`` (TorchRL's
    ``NormalParamExtractor`` with ``biased_softplus_1.0``), ``u = loc + scale * eps``,
    ``action = mid + half * tanh(u)`` and, as ``TanhNormal.rsample_and_log_prob`` scores
    it, ``log p = sum(-eps^2 / 2 - log scale - log(2 pi) / 2 - 2 (log 2 - u - softplus(-2 u)) - log half)``.
    (TorchRL's safe tanh also clamps ``tanh u`` to 1 - 1e-6 in magnitude; here an action
    may reach a bound exactly. The log-density reads ``u``, not the action, so it stays finite.)
    """

    shift: float  # the softplus bias: softplus(0 + shift) + min_scale = 1
    min_scale: float
    scale_lb: float
    mid: torch.Tensor  # (high + low) / 2
    half: torch.Tensor  # (high - low) / 2

    def sample(self, out: torch.Tensor, eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action [N, A], log-probability [N])`` from the head's output ``[N, 2A]``."""
        loc, raw = out.chunk(2, -1)
        scale = (F.softplus(raw + self.shift) + self.min_scale).clamp_min(self.scale_lb)
        if eps is None:
            eps = torch.randn_like(loc)
        u = loc + scale * eps
        log_det = 2.0 * (_LOG_2 - u - F.softplus(-2.0 * u)) + self.half.log()
        logp = (-0.5 * eps.pow(2) - scale.log() - log_det).sum(-1) - _HALF_LOG_2PI * loc.shape[-1]
        return torch.tanh(u) * self.half + self.mid, logp

    def action(self, out: torch.Tensor) -> torch.Tensor:
        """A sampled action alone (collection: no log-probability), the same draw as :meth:`sample`."""
        loc, raw = out.chunk(2, -1)
        scale = (F.softplus(raw + self.shift) + self.min_scale).clamp_min_(self.scale_lb)
        return torch.addcmul(self.mid, torch.tanh(torch.addcmul(loc, scale, torch.randn_like(loc))), self.half)


class FlatSAC:
    """SAC's gradient step on flat tensors, its backward pass written out: an MLP actor, twin MLP critics.

    The parameters stay the ones TorchRL's ``SACLoss`` and ``ProbabilisticActor`` hold
    (so evaluation, saving, ``state_dict`` and ``load_state_dict`` see every step), but
    their storage becomes three flat tensors: the actor, the critics (the twins stacked,
    ``[2, out, in]`` per layer, as ``SACLoss`` holds them) and the target critics in the
    critics' layout. One step, without autograd:

    - target ``y = r + gamma (1 - terminated) (min_j Q'_j(s', a') - alpha log pi(a'|s'))``;
    - critic loss ``mean sum_j (Q_j(s, a) - y)^2``; its gradient, layer by layer
      (``dW = dz^T h``, ``db = sum_rows dz``, ``dh = dz W``, ReLU: ``dz = dh [h > 0]``), is
      written straight into the flat gradient;
    - actor loss ``mean(alpha log pi(a~|s) - min_j Q_j(s, a~))`` with ``a~`` reparametrised:
      ``d/da~`` goes back through the critic each row's minimum came from, on those rows
      only (so the two critics' backward passes together cost one critic's), then
      through the squashing (``d log pi / du = 2 tanh u``, ``da~/du = half (1 - tanh^2 u)``)
      and the actor;
    - temperature: ``d/d log_alpha = -mean(log pi + target_entropy)``;
    - one fused Adam call per flat tensor; Polyak (:meth:`update_targets`) one ``lerp_``.

    The same losses and gradients as ``SACLoss`` (v2, ``loss_function="l2"``) given the
    same noise; a test checks them against it.

    :param actor_params: the actor MLP's weights and biases, input layer first
        (``Linear`` layers with ReLU between them; the last gives ``[loc, raw scale]``).
    :param critic_params: the stacked twin critics' weights and biases, input layer first
        (input: ``[observation, action]``).
    :param target_params: the target critics, same shapes.
    :param log_alpha: the temperature's log (a scalar parameter).
    """

    def __init__(
        self,
        actor_params: list[torch.Tensor],
        critic_params: list[torch.Tensor],
        target_params: list[torch.Tensor],
        log_alpha: nn.Parameter,
        head: SquashedGaussian,
        *,
        gamma: float,
        tau: float,
        target_entropy: float,
        lr: float,
        alpha_lr: float,
    ) -> None:
        self.actor_params, self.critic_params, self.log_alpha, self.head = actor_params, critic_params, log_alpha, head
        self.gamma, self.tau, self.target_entropy = float(gamma), float(tau), float(target_entropy)
        self.actor_flat = flatten_into(actor_params)
        self.critic_flat = flatten_into(critic_params)
        self.target_flat = flatten_into(target_params)
        self.actor_opt = FlatParamsAdam(self.actor_flat, actor_params, lr)
        self.critic_opt = FlatParamsAdam(self.critic_flat, critic_params, lr)
        self.alpha_opt = FlatParamsAdam(log_alpha, [], alpha_lr)
        # plain aliases (no autograd): per network its weights and biases, and their gradients' views
        self._actor = [p.detach() for p in actor_params]
        self._actor_grads = self.actor_opt._grad_views
        self._critics = _twins([p.detach() for p in critic_params])
        self._critic_grads = _twins(self.critic_opt._grad_views)
        self._targets = _twins([t.detach() for t in target_params])

    @staticmethod
    def forward(x: torch.Tensor, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``x [N, in]`` through one MLP (ReLU between layers): ``([x, h_1, ...], output)``."""
        acts = [x]
        last = len(params) - 2
        for i in range(0, len(params), 2):
            z = torch.addmm(params[i + 1], acts[-1], params[i].t())
            if i == last:
                return acts, z
            acts.append(z.relu_())
        raise AssertionError("an MLP has layers")

    @staticmethod
    def backward(
        acts: list[torch.Tensor],
        params: list[torch.Tensor],
        dout: torch.Tensor,
        grads: list[torch.Tensor] | None = None,
        input_cols: slice | None = None,
    ) -> torch.Tensor | None:
        """Backpropagate ``dout`` (d loss / d output) through the MLP of :meth:`forward`'s ``acts``.

        :param grads: views to write the weights' and biases' gradients into (None: not wanted).
        :param input_cols: the input columns whose gradient to return (None: not wanted).
        """
        d = dout
        for k in range(len(params) // 2 - 1, -1, -1):
            w = params[2 * k]
            if grads is not None:
                torch.mm(d.t(), acts[k], out=grads[2 * k])
                torch.sum(d, 0, out=grads[2 * k + 1])
            if k > 0:
                d = torch.ops.aten.threshold_backward(d.mm(w), acts[k], 0.0)  # dh [h > 0]
            elif input_cols is not None:
                return d.mm(w[:, input_cols])
        return None

    def mlp(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """``x [N, in] -> [N, out]`` through one MLP."""
        return self.forward(x, params)[1]

    def twin(self, x: torch.Tensor, nets: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
        """``x [N, in] -> [2, N, 1]``: both critics (one ``mm`` per critic and layer: CPU ``bmm``
        over the stacked pair ran ~1.6x slower)."""
        return torch.stack([self.mlp(x, net) for net in nets])

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """A sampled action for collection."""
        return self.head.action(self.mlp(obs, self._actor))

    @torch.no_grad()
    def update(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        reward: torch.Tensor,
        next_obs: torch.Tensor,
        terminated: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """One gradient step of critics, actor and temperature (not the targets: :meth:`update_targets`).

        :param reward: ``[N, 1]``; :param terminated: ``[N, 1]`` (bool or float).
        :return: the losses (``SACLoss``'s keys) and ``alpha``.
        """
        n, head = obs.shape[0], self.head
        eps_next = torch.randn(n, head.mid.shape[-1])  # SACLoss's order: next actions first
        eps = torch.randn(n, head.mid.shape[-1])
        alpha = self.log_alpha.detach().exp()
        # the target
        next_action, next_logp = head.sample(self.mlp(next_obs, self._actor), eps_next)
        q_next = self.twin(torch.cat([next_obs, next_action], -1), self._targets).min(0).values
        target = reward + self.gamma * (~terminated.bool()) * (q_next - alpha * next_logp.unsqueeze(-1))
        # the critics: loss and gradient
        x = torch.cat([obs, action], -1)
        loss_q = obs.new_zeros(())
        for net, grads in zip(self._critics, self._critic_grads):
            acts, q = self.forward(x, net)
            err = q - target
            loss_q += err.pow(2).mean()
            self.backward(acts, net, err.mul_(2.0 / n), grads)
        # the actor: forward, the critics at its actions, d loss / d action through the minimal critic
        acts, out = self.forward(obs, self._actor)
        loc, raw = out.chunk(2, -1)
        shifted = raw + head.shift
        unclamped = F.softplus(shifted) + head.min_scale
        scale = unclamped.clamp_min(head.scale_lb)
        u = torch.addcmul(loc, scale, eps)
        t = torch.tanh(u)
        new_action = torch.addcmul(head.mid, t, head.half)
        log_det = 2.0 * (_LOG_2 - u - F.softplus(-2.0 * u)) + head.half.log()
        logp = (-0.5 * eps.pow(2) - scale.log() - log_det).sum(-1) - _HALF_LOG_2PI * loc.shape[-1]
        xa = torch.cat([obs, new_action], -1)
        runs = [self.forward(xa, net) for net in self._critics]
        q_min, which = torch.min(torch.stack([q for _, q in runs]), 0)
        d_action = torch.zeros_like(new_action)
        for j, ((acts_j, _), net) in enumerate(zip(runs, self._critics)):
            rows = (which.view(-1) == j).nonzero().view(-1)
            if rows.numel():
                picked = [a.index_select(0, rows) for a in acts_j]
                dq = torch.full((rows.numel(), 1), -1.0 / n)
                d_action.index_copy_(0, rows, self.backward(picked, net, dq, input_cols=slice(obs.shape[-1], None)))  # type: ignore[arg-type]
        loss_actor = (alpha * logp - q_min.squeeze(-1)).mean()
        # back through the squashing and the scale mapping, then the actor
        du = torch.addcmul(t.mul(2.0 * alpha / n), d_action, head.half * (1.0 - t * t))
        d_scale = du * eps - (alpha / n) / scale
        d_raw = d_scale.mul_(torch.sigmoid(shifted)).mul_(unclamped >= head.scale_lb)
        self.backward(acts, self._actor, torch.cat([du, d_raw], -1), self._actor_grads)
        self.critic_opt.step()
        self.actor_opt.step()
        # the temperature
        entropy_gap = logp.mean() + self.target_entropy
        self.log_alpha.grad = -entropy_gap.reshape(self.log_alpha.shape)
        loss_alpha = -self.log_alpha.detach() * entropy_gap
        self.alpha_opt.step()
        return {"loss_qvalue": loss_q, "loss_actor": loss_actor, "loss_alpha": loss_alpha, "alpha": alpha}

    @torch.no_grad()
    def update_targets(self) -> None:
        """Polyak: ``target <- (1 - tau) target + tau critic``."""
        self.target_flat.lerp_(self.critic_flat, self.tau)


def _twins(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stacked ``[2, ...]`` weights and biases -> each critic's list of views."""
    return [p[0] for p in params], [p[1] for p in params]
