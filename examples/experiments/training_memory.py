"""Resident memory and seconds per step of CPU draft training under different C-allocator settings. The arms run
`confu-train` side by side with the same arguments and seed, so the same batches: their step times compare
window by window. Linux, glibc (it reads `/proc/<pid>/status`).

    python examples/experiments/training_memory.py --out results/training_memory \\
        --arm "default:" --arm "trim every 50 steps:TRIM_EVERY=50" \\
        --arm "mmap threshold 4 MB:MALLOC_MMAP_THRESHOLD_=4194304" -- \\
        --data <shards> --init-from <draft> --max-steps 200 --batch-size 8 --max-length 1280 --bf16 ...

An arm is `label:NAME=VALUE,...`, environment variables of its process: glibc's (`MALLOC_*_`) or `TRIM_EVERY=N`,
which calls glibc's `malloc_trim(0)` every N steps. Everything after `--` goes to `confu-train` (give no
`--output-dir` or `--save-minutes`). Writes `<out>.json` (per arm: step, seconds since start, resident GB at each
step), `<out>.md` (a table per window of steps) and `<out>.png`; `--report <out>.json` redraws them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from bisect import bisect_left
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def resident_gb(pid: int) -> float:
    """The process's resident set size (VmRSS) in GiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def follow(proc: subprocess.Popen, max_steps: int, log: Path, series: dict[str, list]) -> None:
    """Copy the run's output to `log`; at each new step of its training progress bar (the one counting to
    `max_steps`), note the time and resident memory."""
    bar = re.compile(rb"(\d+)/%d \[" % max_steps)
    start, last, buffer = time.monotonic(), -1, b""  # the bar's 0/max_steps marks training's start
    with log.open("wb") as out:
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            out.write(chunk)
            buffer = (buffer + chunk)[-200:]
            steps = [int(m.group(1)) for m in bar.finditer(buffer)]
            if steps and steps[-1] > last:
                last = steps[-1]
                try:
                    rss = resident_gb(proc.pid)
                except FileNotFoundError:  # the run ended
                    break
                series["step"].append(last)
                series["seconds"].append(round(time.monotonic() - start, 2))
                series["rss_gb"].append(round(rss, 3))


def run_child(train_args: list[str]) -> None:
    """`confu-train` in this process, with glibc's `malloc_trim(0)` every `$TRIM_EVERY` steps if that is set."""
    import ctypes

    from transformers import TrainerCallback

    from transformers_confu.training import train
    from transformers_confu.training.trainer import ConFuTrainer

    every = int(os.environ.get("TRIM_EVERY", "0"))
    if every:
        trim = ctypes.CDLL("libc.so.6").malloc_trim

        class Trim(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step % every == 0:
                    trim(0)

        setup = ConFuTrainer.__init__

        def with_trim(self, *args, **kwargs):
            setup(self, *args, **kwargs)
            self.add_callback(Trim())

        ConFuTrainer.__init__ = with_trim
    train.main(train_args)


def run_arms(arms: list[str], train_args: list[str], threads: int, workdir: Path) -> dict[str, dict]:
    """Start one `confu-train` per arm at once, follow them to the end; the arms' series by name."""
    if "--max-steps" not in train_args:
        raise SystemExit("give confu-train a --max-steps: its progress bar counts to it")
    max_steps = int(train_args[train_args.index("--max-steps") + 1])
    if any((workdir / f"arm{k}").exists() for k in range(len(arms))):
        raise SystemExit(f"{workdir} holds an earlier run (confu-train would resume it): give a new --workdir")
    results, followers, procs = {}, [], []
    for k, arm in enumerate(arms):
        name, _, settings = arm.partition(":")
        env = dict(item.split("=", 1) for item in settings.split(",") if item)
        series = results[name] = {"environment": env, "step": [], "seconds": [], "rss_gb": []}
        cmd = [sys.executable, __file__, "--child", "--", *train_args,
               "--output-dir", str(workdir / f"arm{k}"), "--save-minutes", "100000"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads), **env})
        procs.append(proc)
        followers.append(threading.Thread(target=follow, args=(proc, max_steps, workdir / f"arm{k}.log", series)))
        followers[-1].start()
    for proc, follower in zip(procs, followers):
        follower.join()
        if proc.wait():
            raise SystemExit(f"confu-train exited with {proc.returncode}: see {workdir}/*.log")
    return results


def windows(series: dict, width: int) -> list[dict]:
    """Per `width` steps: first and last step, seconds per step, peak resident GB and the window's end time."""
    rows, step, seconds, rss = [], series["step"], series["seconds"], series["rss_gb"]
    for end in range(width, step[-1] + 1, width):
        i, j = bisect_left(step, end - width), bisect_left(step, end)  # the first noted step at or past each end
        rows.append(dict(first=end - width + 1, last=end, pace=(seconds[j] - seconds[i]) / (step[j] - step[i]),
                         peak=max(rss[i:j + 1]), ends=seconds[j]))
    return rows


def report(results: dict[str, dict], out: Path, width: int) -> None:
    """`<out>.md`: seconds per step and peak resident memory per window of steps, arm by arm; `<out>.png`.
    Step times count only while every arm still ran (the arms share the cores); memory counts throughout."""
    names = list(results)
    table = {name: windows(results[name], width) for name in names}
    together = min(results[name]["seconds"][-1] for name in names)  # the first arm to end ended then
    n = min(len(rows) for rows in table.values())
    shared = min(sum(row["ends"] <= together for row in table[name]) for name in names)
    head = "| steps | " + " | ".join(f"{name}: s/step | {name}: peak GB" for name in names) + " |"
    lines = [head, "|---" * (1 + 2 * len(names)) + "|"]
    for k in range(n):
        cells = " | ".join((f"{table[name][k]['pace']:.2f}" if k < shared else "(alone)")
                           + f" | {table[name][k]['peak']:.2f}" for name in names)
        lines.append(f"| {table[names[0]][k]['first']}-{table[names[0]][k]['last']} | {cells} |")
    totals = ", ".join(f"{(table[name][shared - 1]['ends'] - results[name]['seconds'][0]) / 60:.1f} min"
                       for name in names)  # from the first step noted (0, or 1 in logs without it)
    lines.append(f"\nSteps 1-{shared * width}, all arms running: {totals} ({', '.join(names)}). Peak resident "
                 "memory: " + ", ".join(f"{max(results[name]['rss_gb']):.2f} GB" for name in names) + ".")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, (mem, pace) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name in names:
        mem.plot(results[name]["step"], results[name]["rss_gb"], label=name)
        rows = table[name][:shared]
        pace.plot([(r["first"] + r["last"]) / 2 for r in rows], [r["pace"] for r in rows], marker="o", label=name)
    mem.set_ylabel("resident memory (GB)")
    pace.set_ylabel(f"seconds per step ({width}-step windows)")
    pace.set_xlabel("training step")
    mem.legend()
    mem.set_title("CPU draft training, the arms side by side")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", help="label:NAME=VALUE,... (environment of one arm); repeat per arm")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per arm")
    p.add_argument("--window", type=int, default=50, help="steps per table row")
    p.add_argument("--workdir", type=Path, default=Path("runs/training_memory"))
    p.add_argument("--out", type=Path, default=Path("results/training_memory"))
    p.add_argument("--report", type=Path, help="redraw the table and figure from this saved JSON; trains nothing")
    p.add_argument("train_args", nargs="*", help="confu-train's arguments (after --)")
    args = p.parse_args()
    if args.child:
        return run_child(args.train_args)
    if args.report:
        results = json.loads(args.report.read_text())["arms"]
    else:
        if not args.train_args or not args.arm:
            p.error("give the arms (--arm) and confu-train's arguments after --")
        args.workdir.mkdir(parents=True, exist_ok=True)
        results = run_arms(args.arm, args.train_args, args.threads, args.workdir)
        record = {"command": sys.argv, "threads_per_arm": args.threads, "arms": results}
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    report(results, args.out, args.window)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
