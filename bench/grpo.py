"""`python grpo.py`'s default run as a benchmark, for seeds 0, 1 and 2 unless told otherwise: accuracy before -> after,
wall time, the step split, peak RSS, the CPU's flags, and the work (training FLOPs, sampled tokens). It is
bench/default_run.py for grpo.py (that script also runs the other four algorithm files).

    python bench/grpo.py                              # seeds 0 1 2, one after the other, then one line per seed
    python bench/grpo.py --seeds 0 -- --dtype float32 # options after -- go to grpo.py
    python bench/grpo.py --run runs/NAME              # only summarise a run that already exists
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--algo" in args:
        sys.stderr.write("bench/grpo.py: --algo: this script runs grpo.py only; use bench/default_run.py --algo NAME\n")
        sys.exit(2)
    ours = args[:args.index("--")] if "--" in args else args
    seeds = [] if "--seeds" in ours or "--run" in ours else ["--seeds", "0", "1", "2"]
    script = Path(__file__).resolve().parent / "default_run.py"
    sys.argv = [str(script), "--algo", "grpo", *seeds, *args]
    runpy.run_path(str(script), run_name="__main__")
