"""s-MoCo (Zhang, Wang, Huang & Scott, "Rethinking Deep Contrastive Learning with Embedding Memory", paper
002): supervised MoCo for deep metric learning. A momentum (key) encoder, theta_M <- m theta_M + (1 - m)
theta (m = 0.999), embeds a second view of every image into a FIFO memory queue that keeps each embedding
with its class label; the batch's queries (first view, the trained encoder) are contrasted with the whole
memory, every entry of the query's class a positive and every other a negative, and the pairs are weighted
by the forms of Table 1 or by the hinge-like HLL of section 3.3 (pretrain/losses/pair_weighting.py).
The contrastive and HLL forms sum over the query's pairs (sec. 3.3, as XBM), so the logged loss grows while the
memory fills: on the digits (20 keys a step, 512 slots) it rises about tenfold over the first 20 steps
(tests/golden/losses.json: 2.4 at step 1, 24.6 at step 20), as the candidates do (20, then about 400), and stops
rising once the memory is full at step 26 (26 to 33 from there to step 60; the digits preset, one thread).

The same method gives the paper's three training schemes (Figure 1, Figure 10):
- s-MoCo: method.memory_size > 0, method.momentum = 0.999;
- XBM: method.momentum = 0: the key encoder is the trained encoder of the last step, so the memory holds
  the trained encoder's (detached) embeddings, as in cross-batch memory;
- mini-batch: method.memory_size = 0: no memory; both views of every image of the batch (negatives gathered
  across processes) are contrasted with each other, with gradients on both sides.

Views: one group of 2 (query, key). With hard view selection a candidate is a pair of the pool: its first
view is the query, its second the key; it is scored against the memory as it is and the local batch's keys.

Logged (`scalars()`):
- smoco/hard_negatives: the number of (query, negative) pairs of the optimizer step, over every process,
  whose similarity exceeds method.hard_negative_similarity (0.5, as Figure 10, right), and
  smoco/hard_negatives_per_query, that number over the queries of the step;
- smoco/feature_drift (section 5.1, after XBM): every method.drift_every_steps steps, the mean over a fixed
  probe of training images (the first method.drift_probe_size images of the first batch, first view, kept
  for the whole run) of ||e_t(x) - e_{t - drift_every_steps}(x)||, e the L2-normalised embedding by the
  encoder that fills the memory (the key encoder; for mini-batch training, which has none, the trained
  encoder). The probe is embedded in train mode (BatchNorm on the probe's batch statistics, as the
  memory is filled) and every buffer is left as it was.

The embedding: the paper adds one fully-connected layer with L2 normalisation after the global pooling of its
ImageNet-pretrained backbone (128 dimensions on ResNet-50; section 4); `model.proj_layers: 1` (the digits config)
is that layer, `model.proj_layers: 2` the MLP of the self-supervised methods. The export carries the trained
encoder's head (`embedding_head_to_export`; the key encoder is its running average): `python -m eval retrieval`
evaluates the embedding by default, as the paper does, and `--features backbone` the backbone's features. The
paper's recipe (Adam with coupled weight decay 5e-4, the lr / 10 at 50% and 80% of training, 4 images per
class in a batch) and what the digits config keeps of it: configs/pretrain/smoco_digits.yaml.

The key encoder and the queue live outside the nn.Module registry (`self.__dict__`), in fp32, like DINO's
teacher (pretrain/methods/dino.py): DeepSpeed never wraps, shards or checkpoints them; the student's
parameters are gathered under ZeRO-3 for the momentum update; they are saved in the checkpoint's client
state and restored on resume. Every process enqueues the keys of the whole global batch, so the queues of
all processes are the same.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from pretrain.hvs import buffers_left_as_they_are
from pretrain.losses.pair_weighting import PairWeighting, pair_weighting_per_anchor
from pretrain.losses.supcon import contrast_set
from pretrain.methods.base import Method, encode_view_groups, require_one_view_group
from pretrain.models import backbone_from_config, projector_from_config
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.distributed import average_buffers, with_sync_batchnorm


@dataclass
class Options:
    name: str = "smoco"
    memory_size: int = 512                   # queue length (embeddings with labels); 0: mini-batch training
    momentum: float = 0.999                  # key encoder EMA m; 0: XBM
    positive_weighting: str = "contrastive"  # Table 1: contrastive | binomial | ms | infonce
    negative_weighting: str = "hll"          # hll (sec. 3.3; a = b: contrastive) | binomial | ms | infonce
    hll_a: float = 0.5                       # negatives below similarity a: weight 0
    hll_b: float = 0.5                       # negatives above similarity b: weight 1 (a <= b, linear between)
    threshold: float = 0.5                   # lambda of the binomial and MS weights
    alpha: float = 2.0                       # positive scale of the binomial and MS weights
    beta: float = 50.0                       # negative scale of the binomial and MS weights
    temperature: float = 0.1                 # tau of the InfoNCE weights
    hard_negative_similarity: float = 0.5    # a negative above this similarity counts as hard (Figure 10)
    drift_every_steps: int = 10              # feature drift over this many steps (0: not measured)
    drift_probe_size: int = 64               # training images whose embeddings the drift follows
    gather_negatives: bool = True            # mini-batch training: contrast with every process's views


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def pair_weighting_of(options) -> PairWeighting:
    return PairWeighting(positive=options.positive_weighting, negative=options.negative_weighting,
                         hll_a=options.hll_a, hll_b=options.hll_b, threshold=options.threshold,
                         alpha=options.alpha, beta=options.beta, temperature=options.temperature)


class SMoCo(Method):
    # Paper 002 initialises its backbone from ImageNet-pretrained parameters (section 4), whose init no zero-init
    # touches: from scratch, torchvision's default (false). Its embedding is one fully-connected layer
    # (model.proj_layers 1: no hidden layer); model.proj_layers 2 is the project's MLP with BatchNorm hidden layers.
    reference_model = {"zero_init_residual": False, "proj_hidden_bn": True}
    # the paper publishes no code: this project's choice
    reference_optim = {"decay_norm_and_bias": False}

    def __init__(self, cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1):
        super().__init__(cfg, steps_per_epoch, schedule_steps)
        method = cfg.method
        self.backbone = backbone_from_config(cfg)
        self.projector = projector_from_config(cfg, self.backbone.num_features)
        self.weighting = pair_weighting_of(method)
        self.memory_size = method.memory_size
        self.momentum = method.momentum if method.memory_size > 0 else 0.0   # mini-batch: the drift follows the student
        self.hard_negative_similarity = method.hard_negative_similarity
        self.drift_every_steps, self.drift_probe_size = method.drift_every_steps, method.drift_probe_size
        self.gather_negatives = method.gather_negatives
        self.sync_batchnorm = cfg.engine.sync_batchnorm

        # Outside the module registry (see the module docstring): fp32, no gradients.
        key_encoder = copy.deepcopy(nn.ModuleDict({"backbone": self.backbone, "projector": self.projector}))
        self.__dict__["key_encoder"] = key_encoder.float().requires_grad_(False)
        dim = cfg.model.proj_out_dim
        self.__dict__["queue"] = torch.zeros(method.memory_size, dim)
        self.__dict__["queue_labels"] = torch.full((method.memory_size,), -1, dtype=torch.long)
        self.queue_next = 0             # the slot the next key goes to
        self.queue_filled = 0           # slots holding a key (the queue fills from slot 0 up, then wraps)
        self.__dict__["probe"] = None                   # (P, C, H, W) the drift probe's images
        self.__dict__["probe_embedding"] = None         # (P, D) their embedding at the last measurement
        self.__dict__["step_hard_negatives"] = torch.zeros(2)   # (hard negatives, queries) of the step so far
        self.__dict__["last_step_hard_negatives"] = torch.zeros(2)
        self.pending_drift: tuple[int, float] | None = None     # (step, drift) not yet logged
        self.steps_done = 0
        self.placed = False             # key encoder and queue on the views' device, equal on every rank

    @staticmethod
    def needs_labels(cfg: DictConfig) -> bool:
        return True

    @staticmethod
    def check_config(cfg: DictConfig) -> None:
        method = cfg.method
        require_one_view_group(cfg, 2, 2)
        try:
            pair_weighting_of(method).check()
        except ValueError as error:
            raise ConfigError(f"method.*: {error} (method.positive_weighting, negative_weighting, hll_a, hll_b, "
                              "alpha, beta, temperature)") from None
        if method.memory_size < 0:
            raise ConfigError(f"method.memory_size={method.memory_size} must be >= 0 (0: mini-batch training)")
        if not 0 <= method.momentum <= 1:
            raise ConfigError(f"method.momentum={method.momentum} must lie in [0, 1] (s-MoCo: 0.999; XBM: 0)")
        if method.drift_every_steps < 0 or method.drift_probe_size < 1:
            raise ConfigError(f"method.drift_every_steps={method.drift_every_steps} must be >= 0 (0: no drift) and "
                              f"method.drift_probe_size={method.drift_probe_size} >= 1")

    # ==== key encoder, queue ====
    def place(self, device: torch.device) -> None:
        """The first time: key encoder and queue on `device`, the key encoder equal to rank 0's everywhere and, on
        GPUs with several processes, with SyncBatchNorm as the student has (`with_sync_batchnorm`, as DINO's teacher):
        otherwise the keys would be normalised with one process's statistics and the queries with the global batch's."""
        if self.placed:
            return
        self.key_encoder.to(device)
        for name in ("queue", "queue_labels", "step_hard_negatives", "last_step_hard_negatives"):
            self.__dict__[name] = self.__dict__[name].to(device)
        for name in ("probe", "probe_embedding"):
            if self.__dict__[name] is not None:
                self.__dict__[name] = self.__dict__[name].to(device)
        if world_size() > 1:
            for tensor in self.key_encoder.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.__dict__["key_encoder"] = with_sync_batchnorm(self.key_encoder, device, world_size(), self.sync_batchnorm)
        self.placed = True

    def encode_keys(self, views: list[torch.Tensor]) -> torch.Tensor:
        encoder = nn.Sequential(self.key_encoder["backbone"], self.key_encoder["projector"])
        with torch.no_grad():
            return F.normalize(encode_view_groups(encoder, [v.float() for v in views]).float(), dim=-1)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, labels: torch.Tensor) -> None:
        """FIFO: the oldest keys make room for `keys` (G, D) with their `labels` (G,)."""
        if self.memory_size == 0:
            return
        keys, labels = keys[-self.memory_size:], labels[-self.memory_size:]
        slots = (self.queue_next + torch.arange(len(keys), device=self.queue.device)) % self.memory_size
        self.queue[slots] = keys.to(self.queue.dtype)
        self.queue_labels[slots] = labels.to(self.queue_labels.device)
        self.queue_next = (self.queue_next + len(keys)) % self.memory_size
        self.queue_filled = min(self.queue_filled + len(keys), self.memory_size)

    def memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(filled, D) keys and (filled,) labels currently in the queue, in slot order."""
        return self.queue[:self.queue_filled], self.queue_labels[:self.queue_filled]

    # ==== forward and losses ====
    def forward(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        # Normalised in fp32: under bf16 the loss still sees unit vectors.
        features, z = encode_view_groups(self.backbone, views, head=self.projector)
        outputs = {"z": F.normalize(z.float(), dim=-1), "features": features}
        self.place(views[0].device)
        if self.training:
            self.key_encoder.train()
            if self.probe is None and self.drift_every_steps:
                self.capture_probe(views[0][:, 0])
        if self.memory_size > 0:
            outputs["keys"] = self.encode_keys(views)
        return outputs

    def sample_loss(self, outputs: dict[str, torch.Tensor], pair: Sequence[int], labels: torch.Tensor) -> torch.Tensor:
        # Scored against the memory as it is plus the local batch's keys at the pair's second view (memory), or
        # within the local batch (mini-batch): cheap, and the same on every process.
        labels = self.class_labels(labels).to(outputs["z"].device)
        a, b = pair
        if self.memory_size == 0:
            contrast = contrast_set(outputs["z"][:, [a, b]], labels, False)
            return contrast.per_sample(pair_weighting_per_anchor(contrast.dots, contrast.positives, contrast.negatives,
                                                                 self.weighting))
        memory, memory_labels = self.memory()
        keys = torch.cat([memory, outputs["keys"][:, b]])
        key_labels = torch.cat([memory_labels, labels])
        similarity = outputs["z"][:, a] @ keys.T
        same = labels[:, None] == key_labels[None, :]
        return pair_weighting_per_anchor(similarity, same, ~same, self.weighting)

    def loss(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        labels = self.class_labels(labels).to(outputs["z"].device)
        if self.memory_size == 0:
            contrast = contrast_set(outputs["z"][:, :2], labels, self.gather_negatives)
            similarity, negatives = contrast.dots, contrast.negatives
            per_anchor = pair_weighting_per_anchor(similarity, contrast.positives, negatives, self.weighting)
        else:
            keys, key_labels = outputs["keys"][:, 1], labels
            if world_size() > 1:            # every process enqueues the whole global batch
                gathered = [torch.empty_like(keys) for _ in range(world_size())]
                dist.all_gather(gathered, keys.contiguous())
                gathered_labels = [torch.empty_like(labels) for _ in range(world_size())]
                dist.all_gather(gathered_labels, labels)
                keys, key_labels = torch.cat(gathered), torch.cat(gathered_labels)
            self.enqueue(keys, key_labels)
            memory, memory_labels = self.memory()
            similarity = outputs["z"][:, 0] @ memory.T
            same = labels[:, None] == memory_labels[None, :]
            negatives = ~same
            per_anchor = pair_weighting_per_anchor(similarity, same, negatives, self.weighting)
        with torch.no_grad():
            hard = ((similarity > self.hard_negative_similarity) & negatives).sum()
            counted = torch.stack([hard.float(), torch.tensor(float(len(similarity)), device=hard.device)])
            self.__dict__["step_hard_negatives"] = self.step_hard_negatives.to(hard.device) + counted
        return per_anchor.mean()

    def class_labels(self, labels: torch.Tensor) -> torch.Tensor:
        self.refuse_unknown_labels(labels, "method.name=smoco needs class labels, but this batch has label -1 "
                                   "(unknown): write the .beton from an image folder with one sub-folder per class")
        return labels

    # ==== feature drift ====
    @torch.no_grad()
    def capture_probe(self, images: torch.Tensor) -> None:
        self.__dict__["probe"] = images[:self.drift_probe_size].detach().float().clone()
        self.__dict__["probe_embedding"] = self.embed_probe()

    @torch.no_grad()
    def embed_probe(self) -> torch.Tensor:
        # fp32 whatever the precision of the step: the probe is first embedded inside the (bf16) forward, then
        # after optimizer steps, and a change of precision must not count as drift.
        with buffers_left_as_they_are([self.key_encoder]), torch.autocast(self.probe.device.type, enabled=False):
            return self.encode_keys([self.probe[:, None]])[:, 0]

    # ==== once per optimizer step ====
    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """key encoder <- m key + (1 - m) student (the student gathered under ZeRO-3); the step's hard-negative
        count; the feature drift at every drift_every_steps-th step."""
        import deepspeed  # heavy: deepspeed (~0.4 s); load_config imports this module for its Options and needs none

        self.steps_done = step
        student = [*self.backbone.parameters(), *self.projector.parameters()]
        keys = [*self.key_encoder["backbone"].parameters(), *self.key_encoder["projector"].parameters()]
        m = self.momentum
        with deepspeed.zero.GatheredParameters(student, modifier_rank=None):
            for s, k in zip(student, keys, strict=True):
                k.mul_(m).add_(s.detach().to(device=k.device, dtype=torch.float32), alpha=1 - m)
        self.__dict__["last_step_hard_negatives"] = self.step_hard_negatives
        self.__dict__["step_hard_negatives"] = torch.zeros_like(self.step_hard_negatives)
        if self.drift_every_steps and step % self.drift_every_steps == 0 and self.probe is not None:
            embedding = self.embed_probe()
            self.pending_drift = (step, (embedding - self.probe_embedding).norm(dim=1).mean().item())
            self.__dict__["probe_embedding"] = embedding

    def scalars(self) -> dict[str, float]:
        counts = self.last_step_hard_negatives.clone()
        if world_size() > 1:
            dist.all_reduce(counts)
        values = {"smoco/hard_negatives": counts[0].item(),
                  "smoco/hard_negatives_per_query": (counts[0] / counts[1].clamp(min=1)).item()}
        if self.pending_drift is not None and self.pending_drift[0] == self.steps_done:   # measured at this step
            values["smoco/feature_drift"] = self.pending_drift[1]
            self.pending_drift = None
        return values

    # ==== checkpoint ====
    def state_outside_engine(self) -> dict:
        """Key encoder, queue (with labels and position), drift probe and step counter. The key encoder's
        BatchNorm statistics (its own forwards, per rank) are averaged first, as the student's are."""
        average_buffers(self.key_encoder)

        def cpu(tensor):
            return None if tensor is None else tensor.detach().cpu().clone()

        return {**super().state_outside_engine(), "key_encoder": {name: t.detach().cpu().clone() for name, t in self.key_encoder.state_dict().items()},
                "queue": cpu(self.queue), "queue_labels": cpu(self.queue_labels), "queue_next": self.queue_next,
                "queue_filled": self.queue_filled, "probe": cpu(self.probe),
                "probe_embedding": cpu(self.probe_embedding), "steps_done": self.steps_done}

    def load_state_outside_engine(self, state: dict) -> None:
        if not state:
            return
        super().load_state_outside_engine(state)
        self.key_encoder.load_state_dict(state["key_encoder"])
        device = self.queue.device
        self.__dict__["queue"] = state["queue"].to(device)
        self.__dict__["queue_labels"] = state["queue_labels"].to(device)
        self.queue_next, self.queue_filled = int(state["queue_next"]), int(state["queue_filled"])
        for name in ("probe", "probe_embedding"):
            self.__dict__[name] = None if state[name] is None else state[name].to(device)
        self.steps_done = int(state["steps_done"])

    def embedding_head_to_export(self) -> nn.Module:
        return self.projector

    def modules_with_buffers(self) -> list[nn.Module]:
        return [self, self.key_encoder]        # the key encoder's BatchNorm statistics move in its forward too


METHOD = SMoCo
