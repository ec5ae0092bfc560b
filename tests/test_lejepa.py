"""LeJEPA (pretrain/methods/lejepa.py, pretrain/losses/lejepa.py): SIGReg against a brute-force Epps-Pulley statistic
and against the integral it approximates, the prediction term and the trade-off, the directions a resumed run draws,
and the settings refused by name. Two processes against one: tests/test_distributed_equality.py; hard view selection
leaves every buffer as it was and picks the brute-force argmax: tests/test_hvs.py."""
import math
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.losses.lejepa import epps_pulley_knots, lejepa_loss, prediction_per_sample, random_directions, sigreg
from pretrain.methods import build_method

CONFIG = Path(__file__).parents[1] / "configs/pretrain/lejepa_digits.yaml"


def brute_force_sigreg(z: torch.Tensor, directions: torch.Tensor, t_max: float, knots: int) -> float:
    """The Epps-Pulley statistic N * integral_{-t_max}^{t_max} |phi_N(t) - exp(-t^2/2)|^2 exp(-t^2/2) dt by the
    trapezoidal rule over the whole symmetric grid (2 knots - 1 points), one view and one direction at a time, in
    float64; averaged over the views and the directions."""
    step = t_max / (knots - 1)
    grid = [step * k for k in range(-(knots - 1), knots)]
    statistics = []
    for view in z.double():
        for direction in directions.double().T:
            x = view @ direction                                           # (N,)
            values = []
            for t in grid:
                real, imaginary = torch.cos(t * x).mean().item(), torch.sin(t * x).mean().item()
                values.append(((real - math.exp(-t * t / 2)) ** 2 + imaginary ** 2) * math.exp(-t * t / 2))
            integral = step * (sum(values) - (values[0] + values[-1]) / 2)
            statistics.append(len(x) * integral)
    return sum(statistics) / len(statistics)


def test_sigreg_is_the_brute_force_epps_pulley_statistic_averaged_over_views_and_directions():
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(3, 10, 5, generator=generator) * torch.tensor([1.0, 0.5, 2.0, 1.0, 0.1])   # 3 views, 10 images
    directions = random_directions(5, 4, generator, torch.device("cpu"))
    assert torch.allclose(directions.norm(dim=0), torch.ones(4))
    for t_max, knots in ((3.0, 17), (2.0, 9)):
        assert sigreg(z, directions, t_max, knots).item() == pytest.approx(brute_force_sigreg(z, directions, t_max,
                                                                                             knots), rel=1e-5)


def test_the_quadrature_converges_to_the_integral_and_the_statistic_sees_a_collapse():
    """With many knots the trapezoidal statistic is the integral itself (scipy's adaptive quadrature of the same
    integrand); a standard normal sample scores near 0, a collapsed one (every embedding equal) far above."""
    from scipy import integrate

    x = torch.randn(200, generator=torch.Generator().manual_seed(1)).double()

    def integrand(t):
        return ((torch.cos(t * x).mean().item() - math.exp(-t * t / 2)) ** 2 + torch.sin(t * x).mean().item() ** 2) \
            * math.exp(-t * t / 2)

    exact = 200 * integrate.quad(integrand, -3, 3, limit=200)[0]
    one_direction = torch.ones(1, 1, dtype=torch.float64)
    t, phi, weights = epps_pulley_knots(3.0, 2001)
    assert torch.allclose(phi, torch.exp(-t ** 2 / 2)) and weights.sum().item() == pytest.approx(
        math.sqrt(2 * math.pi) * math.erf(3 / math.sqrt(2)), rel=1e-6)       # the weight function's integral
    assert sigreg(x.view(1, 200, 1), one_direction, 3.0, 2001).item() == pytest.approx(exact, rel=1e-4)
    normal = sigreg(torch.randn(1, 2000, 8, generator=torch.Generator().manual_seed(2)), torch.eye(8), 3.0, 17)
    collapsed = sigreg(torch.full((1, 2000, 8), 0.3), torch.eye(8), 3.0, 17)
    assert normal.item() < 2 and collapsed.item() > 100 * normal.item()


def test_the_loss_weighs_the_prediction_term_and_sigreg_by_lambda():
    """L = (1 - lambda) L_pred + lambda SIGReg; L_pred of an image is the mean squared distance of its views'
    embeddings to their mean, 0 when the views agree."""
    generator = torch.Generator().manual_seed(3)
    z = torch.randn(6, 4, 5, generator=generator)                          # 6 images, 4 views
    directions = random_directions(5, 7, generator, torch.device("cpu"))
    per_image = torch.stack([((image - image.mean(0)) ** 2).mean() for image in z])
    torch.testing.assert_close(prediction_per_sample(z), per_image)
    assert prediction_per_sample(z[:, :1].expand(6, 4, 5)).abs().max() == 0
    loss, prediction, regulariser = lejepa_loss(z, directions, 0.3)
    torch.testing.assert_close(regulariser, sigreg(z.transpose(0, 1), directions))
    torch.testing.assert_close(loss, 0.7 * per_image.mean() + 0.3 * regulariser)
    with pytest.raises(ValueError, match="lamb=1.5 must be in"):
        lejepa_loss(z, directions, 1.5)


def test_a_resumed_method_draws_the_directions_of_the_uninterrupted_one_and_bad_settings_are_refused():
    """SIGReg's directions are drawn per optimizer step from the run's seed: the same for every process, a different
    set each step, and those of the step a checkpoint resumes at (its step count travels outside the engine)."""
    cfg = load_config(CONFIG, ["model.proj_hidden_dim=32", "model.arch=test_resnet", "model.stem=imagenet"])
    method = build_method(cfg)
    first = method.directions(16, torch.device("cpu"))
    method.after_step(5)
    fifth = method.directions(16, torch.device("cpu"))
    assert not torch.equal(first, fifth) and fifth.shape == (16, 256)
    resumed = build_method(cfg)
    resumed.load_state_outside_engine(method.state_outside_engine())
    assert torch.equal(resumed.directions(16, torch.device("cpu")), fifth)
    for override, message in (("method.lamb=2", "method.lamb=2.0 must be in [0, 1]"),
                              ("method.knots=1", "method.knots=1 >= 2")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(CONFIG, [override])
