"""What a pretraining run logs about its representation while it trains (`monitor.*` keys), at little cost:

- `monitor/rankme`: the effective rank of the batch's backbone features (RankMe, Garrido et al., ICML 2023,
  eq. 1): with the singular values s of the (B, D) feature matrix, p_k = s_k / ||s||_1 + eps and
  RankMe = exp(-sum_k p_k log p_k). It lies between 1 and min(B, D). A collapsing run shows it falling towards
  1 (every image mapped to one direction: SimSiam's and DINO's collapse) while the loss looks fine; a healthy
  run keeps it high or rising. Computed on one batch per process (B images, the first view), it is capped by
  the batch size and is noisier than the paper's 25,600-image estimate: read its trend, not its value.
- `monitor/online_linear_top1`: an online linear probe (as solo-learn's and lightly's online classifier), a
  linear classifier on the *detached* backbone features of the training batch's first view group, trained on
  the batch's labels with its own optimizer (Adam, lr `monitor.online_probe_lr`: its steps do not depend on
  the scale of the features, which differs between backbones and changes during training), never through
  the DeepSpeed engine: the backbone's gradients and the global gradient clipping do not see it. Logged is
  its top-1 on each batch before the batch's update (a running training accuracy, not a validation score).
  Its gradients are averaged over the processes, so every process holds the same probe, and its state
  travels in the checkpoint: a resumed run logs what the uninterrupted one logs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrain.runtime.cpu_threads import one_thread_on_cpu

RANKME_EPS = 1e-7          # Garrido et al. 2023's epsilon


def rankme(features: torch.Tensor, eps: float = RANKME_EPS) -> float:
    """RankMe (Garrido et al. 2023, eq. 1) of a (N, D) matrix: exp of the entropy of its normalised singular values."""
    features = features.detach().float()
    if not torch.isfinite(features).all():        # a diverging step: the loop stops on its loss, not here
        return float("nan")
    with one_thread_on_cpu(features.device):
        singular_values = torch.linalg.svdvals(features)
    p = singular_values / singular_values.sum() + eps
    return float(torch.exp(-(p * torch.log(p)).sum()))


class OnlineLinearProbe:
    """A linear classifier on detached features with its own Adam optimizer; `update` returns the batch's top-1
    before the step. Not an nn.Module of the method, so DeepSpeed neither wraps nor steps it."""

    def __init__(self, num_features: int, num_classes: int, lr: float, seed: int):
        # Drawn from its own generator: the global random state, which the model and the run draw from, is left
        # as it was (nn.Linear's own initialisation, overwritten here, draws from it, hence fork_rng).
        generator = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            self.linear = nn.Linear(num_features, num_classes)
        with torch.no_grad():
            bound = 1.0 / num_features ** 0.5                  # nn.Linear's default initialisation
            self.linear.weight.uniform_(-bound, bound, generator=generator)
            self.linear.bias.uniform_(-bound, bound, generator=generator)
        self.optimizer = torch.optim.Adam(self.linear.parameters(), lr=lr)
        self.num_classes = num_classes

    def to(self, device: torch.device) -> OnlineLinearProbe:
        if self.linear.weight.device != device:
            self.linear.to(device)
            for state in self.optimizer.state.values():
                for name, value in state.items():
                    if torch.is_tensor(value):
                        state[name] = value.to(device)
        return self

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One Adam step on (N, D) features (detached here) and (N,) labels; images labelled -1 (unknown), or with
        non-finite features, are left out. Returns the top-1 of the probe before the step on the images kept (nan
        if none), as a 0-d tensor: nothing here reads a value back from the device, so on a GPU the step does not
        wait for it (the loop reads it on the steps that log). Every process must call it (the gradients are
        all-reduced)."""
        self.to(features.device)
        features = features.detach().float()
        # The images left out weigh 0 rather than being indexed away (a boolean index waits for the device to count
        # them); their features are zeroed, so non-finite ones (a diverging step, which the loop stops on) add
        # nothing either: every process still takes part in the all-reduce below.
        known = (labels >= 0) & torch.isfinite(features).all(dim=1)
        features = torch.where(known[:, None], features, 0.0)
        targets = torch.where(known, labels, 0)
        count = known.sum()
        with torch.enable_grad(), one_thread_on_cpu(features.device):
            logits = self.linear(features)
            loss = (F.cross_entropy(logits, targets, reduction="none") * known).sum() / count.clamp(min=1)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for parameter in self.linear.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= dist.get_world_size()
        self.optimizer.step()
        correct = ((logits.detach().argmax(dim=1) == targets) & known).sum()
        return correct / count                            # 0 / 0: nan when no image is kept

    def state_dict(self) -> dict:
        return {"linear": self.linear.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.linear.load_state_dict(state["linear"])
        self.optimizer.load_state_dict(state["optimizer"])
