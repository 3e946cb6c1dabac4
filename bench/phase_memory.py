"""Resident memory at the phase boundaries of an algorithm file's run: where a step's peak comes from.

    python bench/phase_memory.py eapo -- --prior runs/prior/checkpoint --steps 3 --eval-size 20 --dtype float32
    python bench/phase_memory.py grpo -- --steps 2 --dtype float32
    python bench/phase_memory.py eapo --joint -- --prior runs/prior/checkpoint --steps 2 --eval-size 20 --dtype float32

Runs `<algo>.py` in this process with its `generate`, `update` and `evaluate` wrapped, and prints before and after
each call this process's current RSS, its peak so far (VmHWM) and the anonymous / file-backed parts (Linux: read from
/proc/self/status; GB of 10^9 bytes). A jump of the peak inside a call is that phase's.

--joint (eapo only): sample a step's augmented and ordinary completions in one call on a CPU too, as eapo.py does
on a GPU, where π_RL stays loaded: what its split into two calls saves of the peak (docs/eapo.md).
"""
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import fail, main_guard  # noqa: E402
ALGOS = ("grpo", "exgrpo", "xrpo", "extra", "eapo")
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def memory() -> str:
    """'VmRSS 2.43 VmHWM 3.40 RssAnon 2.25 RssFile 0.18' (GB of 10^9 bytes) from /proc/self/status."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":")[0]
        if name in FIELDS:
            values[name] = int(line.split()[1]) * 1024 / 1e9  # kB of 1024 bytes
    return " ".join(f"{k} {values[k]:.2f}" for k in FIELDS if k in values)


def wrapped(name, fn):
    def call(*args, **kwargs):
        print(f"before {name}: {memory()}", flush=True)
        out = fn(*args, **kwargs)
        print(f"after {name}: {memory()}", flush=True)
        return out
    return call


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):  # the docstring is its help
        print(__doc__.strip())
        return
    if len(sys.argv) < 2 or sys.argv[1] not in ALGOS or not Path("/proc/self/status").is_file():
        fail(f"bench/phase_memory.py: expected an algorithm among {', '.join(ALGOS)} (and Linux's /proc), "
             f"then -- and its options")
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    ours, theirs = sys.argv[2:split], sys.argv[split + 1:]  # this script's flags, then the algorithm file's options
    joint = "--joint" in ours
    if joint and sys.argv[1] != "eapo":
        fail("bench/phase_memory.py: --joint is eapo's (its one sampling call with π_RL on a CPU)")
    module = importlib.import_module(sys.argv[1])
    if joint:  # the GPU's path: π_RL beside all G rows in one call (PriorWeights.apart decides it)
        module.PriorWeights.apart = property(lambda self: False)
    for name in ("generate", "update", "evaluate"):
        if hasattr(module, name):
            setattr(module, name, wrapped(name, getattr(module, name)))
    main_guard(lambda: module.main([a for a in ours if a != "--joint"] + theirs))  # a bad option: one line, exit 2


if __name__ == "__main__":
    main()
