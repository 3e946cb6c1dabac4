"""Process memory on a CPU: hand the heap's freed pages back to the OS, and read this process's peak.

    release_free_memory()      # between the phases of a step (and around each training forward)
    peak_rss_gb()              # logged as perf/peak_rss_gb
"""
import ctypes
import sys

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


def release_free_memory():
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim; a no-op elsewhere). The trainer frees
    hundreds of MB of gradients and activations in tensors of a few MB, which glibc keeps in its heap, mixed with
    live memory, rather than returning them; the sampler's KV cache would then come on top of them. Called
    between the phases of a step, around each training forward (common.batch) and before the embedding's backward
    (common.model); what each call saves is in docs/benchmarks.md."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB of 2^30 bytes (Linux and macOS; 0 elsewhere)."""
    if resource is None:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 30 if sys.platform == "darwin" else peak / 2 ** 20  # bytes on macOS, KiB on Linux
