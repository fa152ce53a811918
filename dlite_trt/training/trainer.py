"""A small, resumable, distributed training loop for the teacher and the student's stages.

The loop is deterministic given (seed, step): each step's batch comes from ``batch_fn(step,
rank, world)``, so a run resumed from a checkpoint reaches exactly the weights of an
uninterrupted run. Checkpoints hold the trainable module's weights (safetensors) and the
optimizer state and step (``torch.save``, a pickle, read back with ``weights_only=True``: PyTorch's
restricted unpickler, which builds tensors and plain containers only, never arbitrary objects).
With torch.distributed initialised (torchrun, any backend), the module is wrapped in
DistributedDataParallel: each rank trains on its shard and gradients are averaged, so every
replica holds the same weights after each step; only rank 0 writes checkpoints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dlite_trt.errors import CheckpointError, ConfigError

CHECKPOINT_WEIGHTS = "trainer_weights.safetensors"
CHECKPOINT_STATE = "trainer_state.pt"


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    checkpoint_every: int = 100  # 0: only at the end
    snapshot_every: int = 0  # > 0: also keep the module's weights every this many steps (snapshot-STEP.safetensors)
    bf16: bool = False  # the loss's forward under bf16 autocast (weights, gradients and optimizer stay fp32)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 0 or \
                self.snapshot_every < 0:
            raise ConfigError(f"invalid training settings {self}: need steps >= 1, lr > 0, warmup/checkpoint >= 0")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def train(module: nn.Module, loss_fn: Callable[[nn.Module, object], dict[str, torch.Tensor]],
          batch_fn: Callable[[int, int, int], object], settings: TrainSettings, out: Path | None = None,
          log: Callable[[int, dict[str, float]], None] | None = None) -> int:
    """Train ``module``'s trainable parameters; returns the number of steps run in this call.

    ``loss_fn(module, batch)`` returns a dict with "loss". Resumes from ``out`` when it holds a
    checkpoint. Distributed, the loss computation runs inside DistributedDataParallel's forward,
    so its gradient hooks average the gradients across ranks.
    """
    rank, world = _distributed()
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: every parameter is frozen")
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    start = _resume(module, optimizer, out) if out is not None else 0
    model: nn.Module = _LossModule(module, loss_fn)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    ran = 0
    for step in range(start, settings.steps):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step)
        batch = batch_fn(step, rank, world)
        with torch.autocast(params[0].device.type, torch.bfloat16, enabled=settings.bf16):
            terms = model(batch)
        optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        if settings.grad_clip > 0:
            nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        ran += 1
        if log is not None and rank == 0:
            log(step, {k: float(v.detach()) for k, v in terms.items()} | {"seconds": time.perf_counter() - started})
        last = step + 1 == settings.steps
        if out is not None and rank == 0 and (last or (settings.checkpoint_every
                                                       and (step + 1) % settings.checkpoint_every == 0)):
            save_checkpoint(module, optimizer, step + 1, out)
        if out is not None and rank == 0 and settings.snapshot_every and (step + 1) % settings.snapshot_every == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()},
                      str(out / f"snapshot-{step + 1}.safetensors"))
    return ran


class _LossModule(nn.Module):
    """The loss as a module's forward: what DistributedDataParallel wraps."""

    def __init__(self, module: nn.Module, loss_fn: Callable[[nn.Module, object], dict[str, torch.Tensor]]) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, batch: object) -> dict[str, torch.Tensor]:
        return self.loss_fn(self.module, batch)


def save_checkpoint(module: nn.Module, optimizer: torch.optim.Optimizer, step: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(weights, str(out / f".{CHECKPOINT_WEIGHTS}.tmp"))
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, out / f".{CHECKPOINT_STATE}.tmp")
    (out / f".{CHECKPOINT_WEIGHTS}.tmp").replace(out / CHECKPOINT_WEIGHTS)  # weights first: a crash
    (out / f".{CHECKPOINT_STATE}.tmp").replace(out / CHECKPOINT_STATE)  # between leaves the old step


def _resume(module: nn.Module, optimizer: torch.optim.Optimizer, out: Path) -> int:
    weights, state = out / CHECKPOINT_WEIGHTS, out / CHECKPOINT_STATE
    if not weights.is_file() and not state.is_file():
        return 0
    if not (weights.is_file() and state.is_file()):
        raise CheckpointError(f"{out} has only one of {CHECKPOINT_WEIGHTS} / {CHECKPOINT_STATE}; the checkpoint is "
                              "incomplete. Delete the directory to start over.")
    try:
        tensors = load_file(str(weights))
        saved = torch.load(state, weights_only=True)
    except Exception as exc:  # safetensors and torch raise various types for a damaged file
        raise CheckpointError(f"cannot read the training checkpoint in {out} ({exc}); delete it to start over.") from exc
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:  # missing, unexpected or mis-shaped tensors
        raise CheckpointError(f"the training checkpoint in {out} is for another model ({exc}); use a new output "
                              "directory.") from exc
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"])
