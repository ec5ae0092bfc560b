"""LeJEPA's loss: views predict each other, and SIGReg keeps their embeddings from collapsing.

Balestriero & LeCun, "LeJEPA: Provable and Scalable Self-Supervised Learning Without the Heuristics", arXiv
2511.08544 (2025), as its reference code computes it (rbalestr-lab/lejepa: MINIMAL.md, the paper's snippets;
lejepa/univariate/epps_pulley.py and lejepa/multivariate/slicing.py, the library's):

    L = (1 - lambda) L_pred + lambda SIGReg

L_pred, the prediction (invariance) term: every view's embedding z_v of an image predicts the mean of that image's
views' embeddings, mean_{i,v,d} (mean_v' z_{i,v',d} - z_{i,v,d})^2.

SIGReg, Sketched Isotropic Gaussian Regularisation: the embeddings of each view across the batch are projected on M
random unit directions a_m (one set per step, the same for every view and every process), and each projection's N
values x are tested against a standard normal by the Epps-Pulley statistic

    T(x) = N * integral over t of |phi_N(t) - exp(-t^2 / 2)|^2 exp(-t^2 / 2) dt,   phi_N(t) = mean_n exp(i t x_n)

integrated by the trapezoidal rule on [-t_max, t_max] (`knots` points on [0, t_max], the weights doubled: the
integrand is even), which is |phi_N - phi|^2 = (mean cos(t x) - exp(-t^2/2))^2 + (mean sin(t x))^2; SIGReg is the
mean of T over the directions and the views. It is a statistic of the whole batch: with several processes the
empirical characteristic function's means are averaged over the processes (differentiably) and N is the global
batch, so two processes on the halves of a batch compute what one process computes on all of it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce


def random_directions(dim: int, count: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(dim, count) directions, each a standard normal vector scaled to unit length (SIGReg's sketch), drawn from
    `generator` (a CPU generator: the same directions on every device and process for the same seed)."""
    directions = torch.randn(dim, count, generator=generator, dtype=torch.float32)
    return (directions / directions.norm(dim=0, keepdim=True)).to(device)


def epps_pulley_knots(t_max: float = 3.0, knots: int = 17) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quadrature of the Epps-Pulley integral: the points t on [0, t_max], the normal's characteristic function
    phi(t) = exp(-t^2 / 2) there, and the trapezoidal weights on [-t_max, t_max] times the weight function phi(t)
    (doubled: the integrand is even; the end points at half weight)."""
    if knots < 2 or t_max <= 0:
        raise ValueError(f"knots={knots} must be >= 2 and t_max={t_max} positive (LeJEPA: 17 knots on [0, 3])")
    t = torch.linspace(0, t_max, knots, dtype=torch.float32)
    step = t_max / (knots - 1)
    weights = torch.full((knots,), 2 * step)
    weights[[0, -1]] = step
    phi = torch.exp(-t.square() / 2)
    return t, phi, weights * phi


def sigreg(z: torch.Tensor, directions: torch.Tensor, t_max: float = 3.0, knots: int = 17,
           gather: bool = True) -> torch.Tensor:
    """SIGReg of embeddings z (V, N, D): V views of N images, D dimensions; `directions` (D, M) unit vectors.

    The Epps-Pulley statistic of each view's N projections on each direction, averaged over the directions and the
    views (a 0-d tensor). With `gather` and several processes, N is every process's images (module docstring)."""
    if z.dim() != 3 or directions.shape[0] != z.shape[-1]:
        raise ValueError(f"z must be (V, N, D) and directions (D, M); got {tuple(z.shape)} and "
                         f"{tuple(directions.shape)}")
    t, phi, weights = (tensor.to(z.device, z.dtype) for tensor in epps_pulley_knots(t_max, knots))
    projected = (z @ directions.to(z.dtype)).unsqueeze(-1) * t                      # (V, N, M, knots)
    cos_mean, sin_mean = projected.cos().mean(1), projected.sin().mean(1)         # (V, M, knots)
    images = z.shape[1]
    if gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        cos_mean, sin_mean = all_reduce(cos_mean) / world, all_reduce(sin_mean) / world
        images *= world
    error = (cos_mean - phi).square() + sin_mean.square()
    return (error @ weights * images).mean()


def prediction_per_sample(z: torch.Tensor) -> torch.Tensor:
    """LeJEPA's prediction term of each image: the mean over its views and dimensions of (the mean of its views'
    embeddings - the view's embedding)^2. z: (N, V, D) -> (N,)."""
    return (z.mean(dim=1, keepdim=True) - z).square().mean(dim=(1, 2))


def lejepa_loss(z: torch.Tensor, directions: torch.Tensor, lamb: float, t_max: float = 3.0, knots: int = 17,
                gather: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1 - lamb) L_pred + lamb SIGReg of embeddings z (N, V, D); returns (loss, L_pred, SIGReg), 0-d tensors."""
    if not 0 <= lamb <= 1:
        raise ValueError(f"lamb={lamb} must be in [0, 1] (LeJEPA's trade-off; the reference uses 0.02-0.05)")
    prediction = prediction_per_sample(z).mean()
    regulariser = sigreg(z.transpose(0, 1), directions, t_max, knots, gather)
    return (1 - lamb) * prediction + lamb * regulariser, prediction, regulariser
