"""Does the code still run a committed default run step for step? The first steps of each run in a benchmark folder
again, every logged metric but perf/ compared with the committed metrics.jsonl.

    python bench/same_run.py bench/results/cpu-2026-11-28-amd-s3                # steps 1-3 of each file's run
    python bench/same_run.py bench/results/cpu-2026-11-28-amd-s3 --algo grpo,xrpo --steps 2

Each run is `python <algo>.py` with the options of the committed run (bench.json's command), --steps N and
--decay-steps 0: the first N steps of a 15-step run never reach its decay, so they are the same steps. The same seed
on the same processor gives the same numbers bit for bit; on another processor they part within the first steps
(docs/grpo.md), so compare on the machine that made the folder. A metric the committed run does not have (one added
since) is listed, not counted as a difference. eapo.py is left out: its π_RL is the seed's whole grpo.py run, whose
checkpoint the folders do not keep. Prints a table; exits 1 if a value differs.
"""
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.config import OneLineParser, fail  # noqa: E402  (a user mistake: one line, exit 2)
ALGOS = ("grpo", "exgrpo", "xrpo", "extra")


def rows(path: Path) -> dict:
    """metrics.jsonl -> {step: every metric logged at that step}."""
    out = {}
    try:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["step"], {}).update(r)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        fail(f"{path}: expected a run's metrics.jsonl, one JSON object with a step per line ({type(e).__name__})")
    return out


def equal(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def compare(new: dict, old: dict, last: int):
    """(values equal, differing [(step, key, new, old)], keys only the new run logs), over steps 0..last (the short
    run's last evaluation is its own: listed with the new keys)."""
    same, differ, only_new = 0, [], set()
    for step in range(last + 1):
        for key, value in new.get(step, {}).items():
            if key.startswith("perf/") or key in ("step", "time"):
                continue
            if key not in old.get(step, {}):
                only_new.add(key)
            elif equal(value, old[step][key]):
                same += 1
            else:
                differ.append((step, key, value, old[step][key]))
    return same, differ, sorted(only_new)


def committed_options(run: Path) -> list:
    """The committed run's options but its --run-name (bench.json's command: the script, then its options)."""
    try:
        argv = json.loads((run / "bench.json").read_text())["command"][1:]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{run / 'bench.json'}: expected bench/default_run.py's record of the run, with its command ({type(e).__name__})")
    i = argv.index("--run-name") if "--run-name" in argv else None
    return argv if i is None else argv[:i] + argv[i + 2:]


def main():
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a benchmark folder of bench-<algo>-s<seed>-* runs")
    p.add_argument("--algo", default=",".join(ALGOS), help="comma-separated, of " + ", ".join(ALGOS))
    p.add_argument("--steps", type=int, default=3, help="steps to run and compare (at most 12 of a 15-step run)")
    args = p.parse_args()
    algos = args.algo.split(",")
    if not set(algos) <= set(ALGOS) or not 1 <= args.steps <= 12:
        fail(f"expected --algo of {', '.join(ALGOS)} and 1 <= --steps <= 12")
    if not any(args.folder.glob("bench-*-s*")):
        fail(f"{args.folder}: expected a folder of bench/default_run.py runs (bench-<algo>-s<seed>-...); none there")
    table, failed = [], False
    for algo in algos:
        runs = sorted(r for r in args.folder.glob(f"bench-{algo}-s*") if r.is_dir())
        if not runs:
            table.append(f"| {algo} | no bench-{algo}-s* run in {args.folder} | | | |")
        for run in runs:  # every seed of the file in the folder
            old = rows(run / "metrics.jsonl")
            with tempfile.TemporaryDirectory() as cwd:  # the run writes runs/<name>/ there, not into the repository
                cmd = [sys.executable, str(REPO / f"{algo}.py"), *committed_options(run), "--run-name", "same",
                       "--steps", str(args.steps), "--decay-steps", "0"]
                print("running:", " ".join(cmd[1:]), flush=True)
                if subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL).returncode != 0:
                    fail(f"{algo}.py stopped with an error (its last line above): not compared")
                new = rows(Path(cwd) / "runs/same/metrics.jsonl")
            same, differ, only_new = compare(new, old, args.steps)
            failed |= bool(differ)
            first = "" if not differ else "step {}: {} {!r} (committed {!r})".format(*differ[0])
            table.append(f"| {algo} | {run.name} | {same} | {len(differ)} {first} | {', '.join(only_new)} |")
    print("\n| file | committed run | values equal | values differing | metrics the committed run lacks |")
    print("|---|---|---|---|---|")
    print("\n".join(table))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
