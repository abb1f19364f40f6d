"""Which vector instructions the CPU kernels are compiled for.

Numba compiles for the host CPU. To measure (or test) the code another CPU gets, a process can
be started with :func:`codegen_env`: ``NUMBA_CPU_NAME`` names the target and
``NUMBA_CPU_FEATURES`` lists its features (the name alone keeps the host's features).
"""

from __future__ import annotations

import os

from numba.core.codegen import get_host_cpu_features

#: Targets a process can be compiled for: name -> (NUMBA_CPU_NAME, features to turn off).
TARGETS = {
    "native": (None, ()),
    "avx2": ("haswell", ("avx512",)),
}


def host_features() -> list[str]:
    """The host CPU's features as LLVM names them (``+avx2``, ``-avx512f``, ...)."""
    return [f for f in get_host_cpu_features().split(",") if f]


def has(feature: str) -> bool:
    """True when the host CPU has ``feature`` (``"avx2"``, ``"avx512f"``)."""
    return f"+{feature}" in host_features()


def codegen_env(target: str) -> dict[str, str]:
    """Environment variables that make numba compile for ``target`` (see :data:`TARGETS`);
    empty for the host's own code."""
    name, off = TARGETS[target]
    if name is None:
        return {}
    features = [("-" + f[1:]) if f.startswith("+") and f[1:].startswith(off) else f
                for f in host_features()]
    return {"NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": ",".join(features)}


def vector_width() -> str:
    """The widest vector extension this process compiles for ("AVX-512", "AVX2", "SSE")."""
    features = os.environ.get("NUMBA_CPU_FEATURES") or ",".join(host_features())
    for flag, name in (("+avx512f", "AVX-512"), ("+avx2", "AVX2")):
        if flag in features.split(","):
            return name
    return "SSE"
