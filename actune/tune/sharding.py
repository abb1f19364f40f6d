"""Per-rank peaks under data parallelism: ``--world-size N --shard {ddp,fsdp}``.

* ``fsdp``: FSDP2 (``fully_shard``) on each block (the blocks ``ckpt`` uses) and on the root:
  parameters, gradients and optimizer state sharded N ways, each block's parameters gathered
  while it runs, the next block's prefetched. The step runs for real in the tracker, under
  fake tensors and torch's fake process group of N ranks (rank 0's view), so the collectives'
  buffers are counted as FSDP allocates them.
* ``ddp``: ``DistributedDataParallel`` keeps every parameter, and its reducer holds a bucket
  copy of every gradient (``gradient_as_bucket_view=False``, the default): the single-device
  peak plus those bucket bytes. (DDP's C++ reducer cannot run under fake tensors.)

Both were checked against the per-rank peaks of real 2-process gloo runs (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

__all__ = ["SHARDINGS", "Sharding", "bucket_bytes", "per_rank_parameter_share",
           "process_group", "release", "shard"]

SHARDINGS = ("ddp", "fsdp")

_OWN: dict = {}  # the fake process group this module made, and its mesh


@dataclass(frozen=True)
class Sharding:
    """How many ranks, and how a model is spread over them."""

    kind: str
    world_size: int

    def __post_init__(self) -> None:
        if self.kind not in SHARDINGS:
            raise ValueError(f"--shard must be one of {', '.join(SHARDINGS)}, not {self.kind!r}")
        if self.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, not {self.world_size}")

    def describe(self) -> dict:
        return {"world_size": self.world_size, "shard": self.kind}


def process_group(world_size: int):
    """A device mesh over ``world_size`` ranks: the running process group's if there is one
    of that size (a real run), else torch's fake process group (an estimate), made once."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            if not _OWN:
                raise ValueError(f"a process group of {dist.get_world_size()} ranks is already "
                                 f"running; --world-size {world_size} needs one of its own")
            release()
            return process_group(world_size)
        if "mesh" not in _OWN:
            from torch.distributed.device_mesh import init_device_mesh

            _OWN["mesh"] = init_device_mesh("cpu", (world_size,))
        return _OWN["mesh"]
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    _OWN["fake"] = True
    return process_group(world_size)


def release() -> None:
    """End the fake process group made here (a real one is its owner's to end)."""
    if _OWN.pop("fake", False) and dist.is_initialized():
        dist.destroy_process_group()
    _OWN.clear()


def shard(model: nn.Module, sharding: Sharding, blocks: list[nn.Module], mesh) -> nn.Module:
    """Apply ``sharding`` to ``model`` in place (FSDP2 on each block, then the root)."""
    if sharding.kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def bucket_bytes(model: nn.Module) -> int:
    """DDP's gradient buckets: a copy of every gradient the model will have."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def per_rank_parameter_share(sharding: Sharding | None) -> tuple[float, float]:
    """(fraction of parameter state each rank keeps, extra bytes per parameter byte)."""
    if sharding is None:
        return 1.0, 0.0
    if sharding.kind == "fsdp":
        return 1.0 / sharding.world_size, 0.0
    return 1.0, 1.0  # ddp: every parameter, and its gradient bucket
