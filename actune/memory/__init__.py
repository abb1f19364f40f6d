"""Memory: the device probe (NVML), and the peak of a training step, measured or estimated."""

from actune.memory.budget import Budget, parse_budget
from actune.memory.nvml import DeviceInfo, probe
from actune.memory.peak import Peak, StepMeter

__all__ = ["Budget", "DeviceInfo", "Peak", "StepMeter", "parse_budget", "probe"]
