"""Process memory on a CPU: hand the heap's freed pages back to the OS, and read this process's peak. Also the
process-wide settings of the CPU math libraries, made when this module is imported, before their first call.

    release_free_memory()      # between the phases of a step (and around each training forward)
    with heap_temporaries():   # a sampling call: its per-token temporaries reuse freed heap blocks
    peak_rss_gb()              # logged as perf/peak_rss_gb
"""
import ctypes
import os
import re
import sys
from contextlib import contextmanager

try:
    import resource
except ImportError:  # not on Windows
    resource = None


def _libc():
    """glibc, whose malloc_trim hands freed heap pages back; None elsewhere (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()

# glibc takes a block of at least M_MMAP_THRESHOLD bytes from mmap, and gives it back to the OS when it is freed; but
# it raises that threshold to the size of each such block freed (up to 32 MB), after which the sampler's per-step
# tensors of a few MB ([rows, vocabulary] logits and probabilities) come from the heap, where freed ones stay mixed
# with live ones: a sampling call's resident memory then creeps up by ~0.1-0.2 x 10^9 bytes over its decode steps.
# A fixed threshold keeps blocks of 1 MB and more on mmap. A sampling call, whose decode steps allocate the same
# large temporaries token after token, raises it for its own duration (heap_temporaries) and trims the heap itself.
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20
_MALLOPT = _LIBC is not None and hasattr(_LIBC, "mallopt")
if _MALLOPT:
    _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)

# In bf16 on a CPU, matmuls run through oneDNN, and both oneDNN and PyTorch's wrapper of it (ideep) keep every
# primitive they build in a cache of 1024 by default, keyed by shape. Training forwards and backwards come in a new
# shape almost every micro-batch (their token counts vary), and each cached primitive holds its own memory:
# `python grpo.py` in bf16 grew by ~0.1-0.2 x 10^9 bytes a step, to a 4.1 x 10^9 B peak. 64 of each still hold a
# micro-batch's shapes, which repeat over the model's layers (the same run peaked at 3.4 x 10^9 B and was no slower;
# bench/shape_memory.py, docs/benchmarks.md). Read when the first primitive is built; a value set in the environment
# wins. fp32 matmuls do not use these caches.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")  # ideep's


def mkl_branch(cpuinfo: str) -> str | None:
    """The MKL_CBWR value for the CPU that /proc/cpuinfo's text describes: "AUTO" on an x86 CPU not made by
    Intel, None (MKL's default) on Intel's and where the vendor is not known."""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo, re.MULTILINE)
    return "AUTO" if vendor and vendor.group(1) != "GenuineIntel" else None


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read(1 << 16)  # the first processors' lines are enough
    except OSError:  # not Linux
        return ""


# MKL, PyTorch's BLAS on x86, takes slower kernels on CPUs not made by Intel than its mode of conditional numerical
# reproducibility does: MKL_CBWR=AUTO, which picks them by the instruction sets the CPU has, and keeps each result the
# same from run to run on the machine. On a 2-core AMD EPYC with AVX2 only, grpo.py's sampling calls took 0.76-0.85x
# the time, a greedy evaluation call 0.91x, a training pass 0.97x (bench/mkl_branch.py), and its default run 0.96x
# (docs/benchmarks.md). Read at MKL's first call; a value set in the environment wins
# (`MKL_CBWR=` keeps MKL's default). Intel's CPUs keep MKL's default; AMD's with AVX-512 were not measured.
_MKL_BRANCH = mkl_branch(_cpuinfo())
if _MKL_BRANCH:
    os.environ.setdefault("MKL_CBWR", _MKL_BRANCH)


def release_free_memory():
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim; a no-op elsewhere). The trainer frees
    hundreds of MB of gradients and activations in tensors of a few MB, which glibc keeps in its heap, mixed with
    live memory, rather than returning them; the sampler's KV cache would then come on top of them. Called
    between the phases of a step, around each training forward (common.batch) and before the embedding's backward
    (common.model); what each call saves is in docs/benchmarks.md."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextmanager
def heap_temporaries(threshold: int = 64 << 20):
    """Inside, blocks under `threshold` bytes come from the heap, not from mmap; after, the fixed threshold again.
    A block taken from mmap is zero-filled page by page when first written (a page fault per 4 KB) and unmapped when
    freed, and a decode step allocates a dozen [rows, vocabulary] temporaries (25 MB each at 128 rows), so under the
    fixed threshold every token paid those faults again: grpo.py's sampling call of 128 rows takes 0.90x the time
    from the heap, one of 64 rows 0.95x (bench/sampler_heap.py). The caller hands freed pages back now and then and
    once it has dropped its temporaries (release_free_memory), so that they do not pile up. The trainer keeps the
    fixed threshold: its update is a run's peak, and what the heap would save it is unsettled (--train there)."""
    if not _MALLOPT:
        yield
        return
    _LIBC.mallopt(M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB of 2^30 bytes (Linux and macOS; 0 elsewhere)."""
    if resource is None:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 30 if sys.platform == "darwin" else peak / 2 ** 20  # bytes on macOS, KiB on Linux
