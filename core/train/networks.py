"""Actor and critic networks, their TorchRL wrappers, and a lean collection policy.

The actor and the critic are separate MLPs (tanh, orthogonal init: the usual PPO
choice). ``ClipPPOLoss`` needs them as TorchRL modules; collection instead runs
:class:`SamplingPolicy`, one plain ``nn.Module`` that samples an action and its
log-probability with the same formulas, without building a distribution object per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Categorical as CategoricalSpec
from torchrl.data import TensorSpec
from torchrl.modules import IndependentNormal, ProbabilisticActor, ValueOperator
from torch.distributions import Categorical


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


@dataclass
class Networks:
    """Everything built from one actor net and one critic net."""

    actor: ProbabilisticActor  # for ClipPPOLoss
    critic: ValueOperator  # writes "state_value"
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


def build_networks(obs_dim: int, action_spec: TensorSpec, hidden: list[int]) -> Networks:
    """Actor and critic for ``obs_dim`` inputs and a Categorical or Bounded action spec."""
    critic_net = mlp(obs_dim, hidden, 1, 1.0)
    critic = ValueOperator(critic_net, in_keys=["observation"])
    if isinstance(action_spec, CategoricalSpec):
        actor_net: nn.Module = mlp(obs_dim, hidden, int(action_spec.n), 0.01)
        module = TensorDictModule(actor_net, in_keys=["observation"], out_keys=["logits"])
        actor = ProbabilisticActor(module, in_keys=["logits"], distribution_class=Categorical,
                                   distribution_kwargs={"validate_args": False}, return_log_prob=True, spec=action_spec)
        return Networks(actor, critic, actor_net, critic_net, True)
    action_dim = int(action_spec.shape[-1])
    actor_net = GaussianHead(mlp(obs_dim, hidden, action_dim, 0.01), action_dim)
    module = TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"])
    actor = ProbabilisticActor(module, in_keys=["loc", "scale"], distribution_class=IndependentNormal,
                               return_log_prob=True, spec=action_spec)
    return Networks(actor, critic, actor_net, critic_net, False)
