"""Where a served replica's CPU time went (benchmarks/replicas_nohit.py).

``thread_times``: the CPU seconds every thread of a process group has used, from
``/proc/PID/task/TID/stat``, by process and kernel thread name (tierkv's threads are named
``tierkv-*``: ``tierkv.threads``). The difference over a replay is what each thread cost: time a
thread spent runnable but waiting for a core is not in it, unlike a sampling profile's.

``summarize_profile``: a summary of a py-spy ``record --format raw --threads --subprocesses``
file (``--profile``): which Python functions the samples caught.

Each line of the file is one stack and how many samples caught it on a CPU (no ``--idle``):
``process PID:"cmdline";thread (TID): name;frame (file:line);... count``. The summary gives,
per process and thread, the CPU seconds sampled, the share spent in tierkv's code, and the
tierkv functions (innermost tierkv frame) and leaf frames that took the most.

    python benchmarks/replicas_profile.py FILE [--rate 100]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from tierkv.testing.processes import group_members

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]*):?\d*\)$")


def _where(frame: str) -> tuple[str, str]:
    match = _FRAME.match(frame)
    return (match.group("function"), match.group("file")) if match else (frame, "")


def _process_label(head: str) -> str:
    pid, _, command = head.removeprefix("process ").partition(":")
    command = command.strip('"')
    if "api_server" in command:
        kind = "api server"
    elif command:
        kind = command.split()[0].rsplit("/", 1)[-1]
    else:
        kind = "?"
    return f"{pid} {kind}"


_TICK = os.sysconf("SC_CLK_TCK")


def _thread_name(name: str) -> str:
    """Kernel thread names with their numbers dropped: ``tierkv-io-1`` -> ``tierkv-io``."""
    return re.sub(r"[-_]?\d+$", "", name) or name


def thread_times(pgid: int) -> Counter[tuple[str, str]]:
    """CPU seconds per (process name, thread name) of every process in group ``pgid`` so far."""
    times: Counter[tuple[str, str]] = Counter()
    for pid in group_members(pgid) or {}:
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            times[(process, _thread_name(name))] += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return times


def summarize_profile(path: Path, rate: float = 100.0, top: int = 6) -> dict[str, dict[str, float]]:
    """Print the summary of one raw profile; returns {process: {thread: seconds}}."""
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    tierkv: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    leaves: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        parts = stack.split(";")
        heads = [p for p in parts if p.startswith("process ")]  # parent first, the sampled process last
        process = _process_label(heads[-1]) if heads else "?"
        thread = next((p.split(": ", 1)[-1] for p in parts if p.startswith("thread (")), "?")
        frames = [p for p in parts if not p.startswith(("process ", "thread ("))]
        count = int(count_text)
        threads[process][thread] += count
        ours = [_where(f) for f in frames if "tierkv/" in _where(f)[1]]
        if ours:
            function, file = ours[-1]
            tierkv[(process, thread)][f"{function} ({file.rsplit('tierkv/', 1)[-1]})"] += count
        if frames:
            function, file = _where(frames[-1])
            leaves[(process, thread)][f"{function} ({file.rsplit('/', 1)[-1]})"] += count
    print(f"\n-- {path.name}: CPU seconds sampled per process and thread (rate {rate:.0f}/s) --")
    summary: dict[str, dict[str, float]] = {}
    for process, per_thread in sorted(threads.items()):
        summary[process] = {}
        for thread, samples in per_thread.most_common():
            seconds = samples / rate
            summary[process][thread] = seconds
            ours = sum(tierkv[(process, thread)].values())
            if seconds < 0.05:
                continue
            print(f"{process:>28}  {thread:<28} {seconds:7.2f} s  tierkv {ours / samples:5.1%}")
            for name, hits in tierkv[(process, thread)].most_common(top):
                print(f"{'':>32}tierkv {hits / rate:6.2f} s  {name}")
            for name, hits in leaves[(process, thread)].most_common(3):
                print(f"{'':>32}leaf   {hits / rate:6.2f} s  {name}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--rate", type=float, default=100.0)
    args = parser.parse_args()
    for path in args.files:
        summarize_profile(path, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
