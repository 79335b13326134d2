"""What this CPU is: its model name, the ISA flags the kernels care about, and whether AMX is usable.

Hosts of one machine kind differ (a Zen 4 EPYC with AVX512-BF16 and no AMX, a Xeon with AMX tiles), and a kernel
tuned on one loses up to 5x on the other. These facts key the kernel-selection cache
(:mod:`pagoda.cpu.kernel_selection`) and are printed beside benchmark tables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

logger = logging.getLogger(__name__)

# The flags (as /proc/cpuinfo spells them) that decide which linear kernel is fastest.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

# Linux x86-64: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Since Linux 5.16 a process must ask before it
# touches the AMX tile data registers, or its first tile instruction is killed with SIGILL.
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@functools.cache
def _cpuinfo_fields() -> tuple[str, frozenset[str]]:
    """(model name, all flags) of the first processor in /proc/cpuinfo; ('', {}) where there is none."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name, e.g. 'AMD EPYC 9R14' (a VM may show only 'AMD EPYC')."""
    return _cpuinfo_fields()[0]


def cpu_flags() -> frozenset[str]:
    """Every feature flag the kernel reports for this CPU."""
    return _cpuinfo_fields()[1]


def isa_flags() -> dict[str, bool]:
    """The flags of :data:`ISA_FLAGS`, present or not."""
    flags = cpu_flags()
    return {name: name in flags for name in ISA_FLAGS}


def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile-data permission of this process; True once granted (idempotent).

    Only called where the CPU reports ``amx_tile``: elsewhere the request fails anyway. oneDNN asks for itself as
    well; asking here makes the answer visible in the log and covers our own code.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM), XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        return False
    if rc != 0:
        logger.warning("AMX: the CPU has tiles but Linux refused tile data (errno %d)", ctypes.get_errno())
    return rc == 0


@functools.cache
def amx_available() -> bool:
    """Whether AMX-BF16 tiles can run in this process: CPUID reports them (via the kernel's flags) and Linux granted
    the tile-data permission. Logged once."""
    flags = cpu_flags()
    if not {"amx_tile", "amx_bf16"} <= flags:
        logger.info("AMX: not on this CPU (%s); the AVX-512/AVX2 kernels serve every shape", cpu_model())
        return False
    granted = request_amx_permission()
    if granted:
        logger.info("AMX: tiles available on %s (amx_int8: %s)", cpu_model(), "amx_int8" in flags)
    return granted
