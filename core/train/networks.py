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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torchrl.data import Categorical as CategoricalSpec
from torchrl.data import TensorSpec

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


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

    Categorical: ``log_softmax`` + ``multinomial``; Gaussian: ``loc + std * noise`` with
    the summed normal log-density (what ``IndependentNormal`` computes).
    """

    def __init__(self, actor_net: nn.Module, discrete: bool, log_prob_key: str) -> None:
        super().__init__()
        self.actor_net = actor_net
        self.discrete = discrete
        self.log_prob_key = log_prob_key

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        obs = td.get("observation")
        if self.discrete:
            logp = torch.log_softmax(self.actor_net(obs), dim=-1)
            action = torch.multinomial(logp.exp(), 1)
            td.set("action", action.squeeze(-1))
            td.set(self.log_prob_key, logp.gather(-1, action).squeeze(-1))
        else:
            loc, std = self.actor_net(obs)
            noise = torch.randn_like(loc)
            td.set("action", loc + std * noise)
            log_prob = -0.5 * noise.pow(2) - std.log() - 0.5 * torch.log(torch.tensor(2 * torch.pi))
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
