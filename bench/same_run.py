"""Does the code still run a committed default run step for step? The first steps of each run in a benchmark folder
again, every logged metric but perf/ compared with the committed metrics.jsonl.

    python bench/same_run.py bench/results/cpu-2026-11-28-amd-s3                # steps 1-3 of each file's run
    python bench/same_run.py bench/results/cpu-2026-11-28-amd-s3 --algo grpo,xrpo --steps 2

Each run is `python <algo>.py` with the options of the committed run (bench.json's command), --steps N and
--decay-steps 0: the first N steps of a 15-step run never reach its decay, so they are the same steps. The same seed
on the same processor gives the same numbers bit for bit; on another processor they part within the first steps
(docs/grpo.md), so compare on the machine that made the folder. A metric the committed run does not have (one added
since) is listed, not counted as a difference. Prints a table; exits 1 if a value differs.

    python bench/same_run.py bench/results/cpu-2026-11-28-amd-s3 --algo eapo   # ~12 min on 2 cores

    python bench/same_run.py bench/results/cpu-2026-11-29-intel --against bench/results/cpu-2026-11-27-rerun

--against compares the folder's runs with those of the same file and seed in other folders, every step, and runs
nothing: whether two benchmark sessions on one kind of processor made the same runs.

eapo.py runs only when asked: its π_RL is the seed's whole grpo.py run, whose checkpoint the folders do not keep, so
that run is repeated first, all its steps, and compared as well (a row of its own), then eapo.py's first steps take
its checkpoint as --prior.
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
ALGOS = ("grpo", "exgrpo", "xrpo", "extra")  # the default; eapo too when asked (--algo eapo)


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


def committed_options(run: Path, drop=("--run-name",)) -> list:
    """The committed run's options but its --run-name (bench.json's command: the script, then its options)."""
    try:
        argv = json.loads((run / "bench.json").read_text())["command"][1:]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{run / 'bench.json'}: expected bench/default_run.py's record of the run, with its command ({type(e).__name__})")
    for option in drop:
        i = argv.index(option) if option in argv else None
        argv = argv if i is None else argv[:i] + argv[i + 2:]
    return argv


def rerun(algo: str, run: Path, cwd: str, steps: int | None, extra: tuple = ()) -> dict:
    """The committed run again in cwd (runs/same-<algo>/), its first `steps` steps (None: all of them); its metrics."""
    drop = ("--run-name", "--prior") if "--prior" in extra else ("--run-name",)
    cmd = [sys.executable, str(REPO / f"{algo}.py"), *committed_options(run, drop), *extra, "--run-name", f"same-{algo}"]
    if steps is not None:
        cmd += ["--steps", str(steps), "--decay-steps", "0"]
    print("running:", " ".join(cmd[1:]), flush=True)
    if subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL).returncode != 0:
        fail(f"{algo}.py stopped with an error (its last line above): not compared")
    return rows(Path(cwd) / f"runs/same-{algo}/metrics.jsonl")


def prior_run(run: Path) -> Path:
    """The committed grpo.py run whose checkpoint an eapo.py run took as --prior: a folder beside it."""
    options = committed_options(run)
    prior = Path(options[options.index("--prior") + 1]) if "--prior" in options else None
    if prior is None or not (run.parent / prior.parent.name / "metrics.jsonl").is_file():
        fail(f"{run}: expected its --prior to name a grpo.py run of the same folder, got {prior}")
    return run.parent / prior.parent.name


def main():
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a benchmark folder of bench-<algo>-s<seed>-* runs")
    p.add_argument("--algo", default="", help="comma-separated, of " + ", ".join(ALGOS) + ", eapo (default: "
                   "all but eapo; all five with --against)")
    p.add_argument("--steps", type=int, default=3, help="steps to run and compare (at most 12 of a 15-step run)")
    p.add_argument("--against", type=Path, nargs="+", default=[],
                   help="folders of runs made before: compare every step with their runs of the file and seed, run nothing")
    args = p.parse_args()
    algos = args.algo.split(",") if args.algo else [*ALGOS, "eapo"] if args.against else list(ALGOS)
    if not set(algos) <= {*ALGOS, "eapo"} or not 1 <= args.steps <= 12:
        fail(f"expected --algo of {', '.join(ALGOS)}, eapo and 1 <= --steps <= 12")
    for folder in (args.folder, *args.against):
        if not any(folder.glob("bench-*-s*")):
            fail(f"{folder}: expected a folder of bench/default_run.py runs (bench-<algo>-s<seed>-...); none there")
    table, failed = [], False

    def row(algo, name, new, old, last):
        nonlocal failed
        same, differ, only_new = compare(new, old, last)
        failed |= bool(differ)
        first = "" if not differ else "step {}: {} {!r} (committed {!r})".format(*differ[0])
        table.append(f"| {algo} | {name} | {same} | {len(differ)} {first} | {', '.join(only_new)} |")

    for algo in algos:
        runs = sorted(r for r in args.folder.glob(f"bench-{algo}-s*") if r.is_dir())
        if not runs:
            table.append(f"| {algo} | no bench-{algo}-s* run in {args.folder} | | | |")
        for run in runs:  # every seed of the file in the folder
            if args.against:  # runs made before: compared, every step, with each run of the file and seed there
                seed = run.name.split("-")[2]
                for other in sorted(r for f in args.against for r in f.glob(f"bench-{algo}-{seed}-*") if r.is_dir()):
                    old = rows(other / "metrics.jsonl")
                    row(algo, f"{run.name} against {other.parent.name}/{other.name}", rows(run / "metrics.jsonl"), old,
                        max(old))
                continue
            with tempfile.TemporaryDirectory() as cwd:  # the runs write runs/<name>/ there, not into the repository
                extra = ()
                if algo == "eapo":  # π_RL first: the seed's whole grpo.py run, itself compared step for step
                    prior = prior_run(run)
                    old_prior = rows(prior / "metrics.jsonl")
                    row("grpo (π_RL)", prior.name, rerun("grpo", prior, cwd, None), old_prior, max(old_prior))
                    extra = ("--prior", str(Path(cwd) / "runs/same-grpo/checkpoint"))
                new = rerun(algo, run, cwd, args.steps, extra)
            row(algo, run.name, new, rows(run / "metrics.jsonl"), args.steps)
    print("\n| file | committed run | values equal | values differing | metrics the committed run lacks |")
    print("|---|---|---|---|---|")
    print("\n".join(table))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
