"""Where the daemon's CPU goes: `gpu-agent run` in this process, sampled by thread CPU clock.

Every `--interval-ms` a sampler thread reads each thread's own CPU clock
(`pthread_getcpuclockid`) and charges the CPU that thread used since the last sample to the stack
it is in now. A thread blocked in a wait uses no CPU and so is charged nothing, which a wall-clock
sampler cannot tell apart; cProfile cannot be used here, because since Python 3.12 it follows one
thread's calls at a time. Prints the functions with the most CPU, inclusive (anywhere in the stack)
and self (the frame running), and CPU by thread name.

Usage: python3 -m bench.daemon_profile --config agent.yaml [--seconds 60] [--warmup 10] [--interval-ms 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from types import FrameType


def frame_key(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    marker = path.rfind("/agent/")
    short = path[marker + 1 :] if marker >= 0 else os.path.basename(path)
    return f"{short}:{code.co_firstlineno} {code.co_qualname}"


class CpuSampler:
    def __init__(self, interval_seconds: float) -> None:
        self.interval_seconds = interval_seconds
        self.inclusive: Counter[str] = Counter()
        self.self_time: Counter[str] = Counter()
        self.by_thread: Counter[str] = Counter()
        self.recording = False
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        own = threading.get_ident()
        while not self._stop.wait(self.interval_seconds):
            frames = sys._current_frames()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in frames.items():
                if ident == own:
                    continue
                try:
                    used = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except OSError:  # the thread ended between the two reads
                    continue
                spent = used - self._last.get(ident, used)
                self._last[ident] = used
                if not self.recording or spent <= 0:
                    continue
                self.by_thread[names.get(ident, str(ident))] += spent
                self.self_time[frame_key(frame)] += spent
                seen: set[str] = set()
                walk: FrameType | None = frame
                while walk is not None:
                    key = frame_key(walk)
                    if key not in seen:
                        seen.add(key)
                        self.inclusive[key] += spent
                    walk = walk.f_back


def print_top(title: str, counts: Counter[str], total: float, limit: int) -> None:
    print(f"{title} (seconds, % of the daemon's CPU):")
    for key, seconds in counts.most_common(limit):
        print(f"  {seconds:8.3f}  {100 * seconds / total:5.1f} %  {key}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.daemon_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)

    from agent.cli import main as agent_main

    sampler = CpuSampler(args.interval_ms / 1e3)
    sampler.start()

    def record() -> None:
        time.sleep(args.warmup)
        sampler.recording = True
        started = time.monotonic()
        cpu_before = os.times()
        time.sleep(args.seconds)
        sampler.recording = False
        cpu_after = os.times()
        elapsed = time.monotonic() - started
        used = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
        share = 100 * used / elapsed
        print(f"process CPU over {elapsed:.1f} s: {used:.3f} s = {share:.2f} % of one core (sampler included)")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=record, name="recorder", daemon=True).start()
    code = agent_main(["run", "--config", args.config, "--log-level", "warning"])
    sampler.stop()
    total = sum(sampler.by_thread.values()) or 1e-9
    print(f"daemon exited {code}; CPU charged to samples: {total:.3f} s")
    print_top("by thread", sampler.by_thread, total, args.top)
    print_top("inclusive", sampler.inclusive, total, args.top)
    print_top("self", sampler.self_time, total, args.top)


if __name__ == "__main__":
    main()
