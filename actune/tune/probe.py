"""One trial: a training step of a workload at a level and size, and its peak memory.

In ``estimate`` mode and in ``measure`` mode on the CPU the step runs in this process; in
``measure`` mode on a GPU each trial runs in a fresh subprocess (``python -m
actune.tune.probe``), so an out-of-memory error there poisons nothing, with a timeout.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

import actune
from actune import tunables
from actune.memory import Peak, StepMeter
from actune.memory.gpu_model import GpuModel
from actune.memory.trace import note_empty_cache
from actune.tune.alternatives import Config, apply_checkpointing, get_config, repeated_blocks
from actune.tune.oom import is_oom
from actune.tune.search import Probe
from actune.tune.sharding import Sharding, bucket_bytes, process_group, shard
from actune.tune.sources import from_source
from actune.tune.workload import Workload, WorkloadError, first_line

__all__ = ["ProbeError", "Trial", "prepare", "warm_up"]


class ProbeError(RuntimeError):
    """A trial failed for a reason other than running out of memory."""


@dataclass(frozen=True)
class Trial:
    """What to run: a workload at a configuration (a level, perhaps with checkpointing or
    offload), with scalable sizes, in a mode on a device."""

    workload: Workload
    config: Config
    sizes: dict
    mode: str = "estimate"
    device: str = "cpu"
    round_to: int | None = None
    sharding: Sharding | None = None  # per rank of a data-parallel run (sharding.py)
    gpu: GpuModel | None = None  # an estimate for this GPU kind (memory/gpu_model.py)

    def __post_init__(self) -> None:  # a Level (or its name) stands for itself alone
        object.__setattr__(self, "config", get_config(self.config))
        if self.sharding is not None and self.sharding.world_size == 1:
            object.__setattr__(self, "sharding", None)  # one rank: nothing is spread

    def _parts(self):
        wl, config, sizes, device = self.workload, self.config, self.sizes, self.device
        sharding = self.sharding
        mesh = (process_group(sharding.world_size) if sharding and sharding.kind == "fsdp"
                else None)  # made outside fake tensors

        def build():  # (in an estimate, initial values are not set: nothing reads them)
            model = prepare(wl, config, wl.model(self.mode != "estimate", **sizes))
            if mesh is not None:
                shard(model, sharding, blocks_of(wl, model), mesh)
            return model, wl.make_optimizer(model)

        def step(model, opt, batch, sink):
            # (a model shared by the trials of several configurations: the loss path as
            # this one has it; nothing for a model that is not a causal LM)
            actune.chunk_loss(model, on=config.chunks_loss)
            inputs, targets = wl.make_batch(batch, sizes.get("resolution"))
            opt.zero_grad(set_to_none=True)
            with actune.compressed(config.run_level, stats=sink), config.saving(device):
                loss = wl.step_loss(model, inputs, targets)
            if config.level.defrag:  # (a real CUDA step empties the cache there)
                note_empty_cache()
            loss.backward()
            opt.step()

        return build, step

    @functools.cached_property
    def meter(self) -> StepMeter:
        """The meter of this trial's steps: the model is built and warmed up once, and in an
        estimate shared with every trial that builds the same model (:func:`_shared_key`)."""
        meter = StepMeter(*self._parts(), self.mode, self.device, self.round_to,
                          warm_optimizer_only=self.sharding is None, gpu=self.gpu)
        key = _shared_key(self)
        if key is None:
            return meter
        found = _WARM.get(key)
        if found is not None and found[0] is self.workload:
            meter.fake, meter.model, meter.opt = found[1:]
            _WARM.move_to_end(key)
        else:
            meter.warm()
            _WARM[key] = (self.workload, meter.fake, meter.model, meter.opt)
            while len(_WARM) > tunables.WARM_MODELS:
                _WARM.popitem(last=False)
        return meter

    def peak(self, batch: int) -> Peak:
        """Peak of one step at ``batch`` (raises on out-of-memory or any other error); per
        rank under ``sharding`` (DDP: plus its gradient buckets)."""
        if self.mode == "measure" and torch.device(self.device).type == "cuda":
            return _isolated(self, batch)
        try:
            peak = self.meter.peak(batch)
        except (WorkloadError, ProbeError):
            raise
        except Exception as err:
            if is_oom(err):
                raise
            name = self.config.name
            raise ProbeError(f"{name}: a step at batch {batch} failed with "
                             f"{type(err).__name__}: {first_line(err)} (--debug shows the "
                             f"traceback; leave {name} out of --levels to tune the rest)"
                             ) from err
        if self.sharding and self.sharding.kind == "ddp":
            buckets = bucket_bytes(self.meter.model)
            peak = dataclasses.replace(peak, total=peak.total + buckets,
                                       gradients=peak.gradients + buckets,
                                       reserved=peak.reserved + buckets if peak.reserved else 0)
        return peak

    def probe(self, batch: int, budget: int) -> Probe:
        """Does ``batch`` fit ``budget``? Out-of-memory means no; other errors propagate."""
        try:
            peak = self.peak(batch)
        except Exception as err:
            if is_oom(err) or (isinstance(err, ProbeError) and "out of memory" in str(err)):
                return Probe(batch, False, None)
            raise
        return Probe(batch, peak.fit_bytes <= budget, peak.fit_bytes,
                     peak.parameters + peak.gradients + peak.optimizer, peak.saved)


#: Built and warmed-up fake models of recent estimate trials (the workload, the fake mode,
#: the model, its optimizer), shared by the trials of every configuration that builds the same
#: model: the levels differ only in how a step runs, not in the model or its optimizer state.
_WARM: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


def _shared_key(trial: Trial) -> tuple | None:
    """What the model of an estimate trial depends on (None: not shared; real tensors and
    sharded models are built per trial)."""
    if trial.mode != "estimate" or trial.sharding is not None:
        return None
    return (id(trial.workload), tuple(sorted(trial.sizes.items())), trial.config.checkpoint,
            trial.config.whole, trial.device)


def warm_up(trial: Trial) -> None:
    """Build and warm up ``trial``'s model now (before trials are forked off, so that they
    share it)."""
    trial.meter  # noqa: B018 - the property builds it


def blocks_of(workload: Workload, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks: the model file's ``checkpoint_blocks(model)``, else its repeated
    blocks (what ``ckpt`` checkpoints and FSDP shards one by one)."""
    return list(workload.blocks_fn(model)) if workload.blocks_fn else repeated_blocks(model)


def prepare(workload: Workload, config: Config, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` made ready for ``config``'s steps: batch norms allowed in place, a causal
    LM's loss in chunks where the configuration has it (as :func:`actune.compress` does at a
    compressing level), and its blocks checkpointed if the configuration asks for it."""
    actune.allow_inplace_norms(model)
    if config.chunks_loss:
        actune.chunk_loss(model)
    if config.checkpoint:
        apply_checkpointing(model, blocks_of(workload, model), whole=config.whole)
    return model


def _isolated(trial: Trial, batch: int) -> Peak:  # pragma: no cover - needs a GPU
    spec = json.dumps({"source": trial.workload.source, "precision": trial.workload.precision,
                       "lora": trial.workload.lora,
                       "config": trial.config.to_json(),
                       "sizes": trial.sizes, "batch": batch, "device": trial.device})
    try:
        done = subprocess.run([sys.executable, "-m", "actune.tune.probe", spec],
                              capture_output=True, text=True, timeout=tunables.TRIAL_TIMEOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as err:
        raise ProbeError(f"a trial at batch {batch} took over {tunables.TRIAL_TIMEOUT} s") from err
    if done.returncode == 3:
        raise ProbeError(f"out of memory at batch {batch}")
    if done.returncode != 0:
        raise ProbeError(f"the trial at batch {batch} failed:\n{done.stderr.strip()[-2000:]}")
    return Peak(**json.loads(done.stdout.strip().splitlines()[-1]))


def _main(argv: list[str]) -> int:  # pragma: no cover - runs in the isolated subprocess
    spec = json.loads(argv[0])
    workload = from_source(spec["source"])
    workload.precision = spec.get("precision", "32-true")
    workload.lora = spec.get("lora")
    trial = Trial(workload, Config.from_json(spec["config"]), spec["sizes"], "measure",
                  spec["device"])
    history = os.environ.get("ACTUNE_MEMORY_HISTORY")  # a path: the allocator's own trace
    if history:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        peak = StepMeter(*trial._parts(), "measure", spec["device"]).peak(spec["batch"])
    except Exception as err:
        if is_oom(err):
            return 3
        raise
    if history:
        torch.cuda.memory._dump_snapshot(history)
    print(json.dumps(peak.as_dict()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main(sys.argv[1:]))


