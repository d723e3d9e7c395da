"""Several benchmark engines alive at once, each in its own process, driven one command at a time.

Batch-1 decode steps of small targets are host-bound, and their host time drifts by up to ~1.5 ms over seconds to
minutes (other processes on the host), so configurations measured one after the other compare different moments.
Driving every configuration's engine from one coordinator lets their timed repeats alternate — chain, ddtree,
chain, ddtree, … — so each ratio compares neighbours in time. Only one engine works at any moment (every command
waits for its answer), so they never share the GPU while timed.

The child protocol (``bench/step_time.py --serve``): the child prints ``READY`` once its engine is built, then
answers each command line on its stdin with one line on stdout — ``OK`` or ``RESULT <json>`` — and exits at EOF.
Other stdout lines are ignored; stderr goes to a file (kept when a path is given) whose tail is raised with the
error if the child dies.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, NoReturn


class ChildDied(RuntimeError):
    """A child exited (or closed its stdout) before answering."""


class Child:
    """One engine process: send a command, read its answer."""

    def __init__(
        self, cmd: Sequence[str], label: str, log: Path | None = None, cpus: frozenset[int] | None = None
    ) -> None:
        self.label = label
        self._log = log
        self._err: IO[str] = open(log, "w+") if log else tempfile.TemporaryFile(mode="w+")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # inherited by the engine core process
        self._proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            bufsize=1,
            preexec_fn=pin,
        )
        self._answer("READY")

    def ask(self, command: str) -> str:
        """Send one command; its answer line (``OK`` or ``RESULT <json>``)."""
        try:
            self._proc.stdin.write(command + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._died(f"before '{command}'")
        return self._answer("OK", "RESULT ")

    def row(self) -> dict:
        """The child's result row for the cell it last measured."""
        answer = self.ask("row")
        if not answer.startswith("RESULT "):
            raise ChildDied(f"{self.label}: answered '{answer}' to 'row'")
        return json.loads(answer[len("RESULT ") :])

    def close(self) -> None:
        """EOF on stdin: the child shuts its engine down and exits."""
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        self._proc.wait()
        self._err.close()

    def _answer(self, *prefixes: str) -> str:
        for line in self._proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(prefixes):
                return line
        self._died(f"while waiting for {' or '.join(prefixes)}")

    def _died(self, when: str) -> NoReturn:
        self._proc.wait()
        self._err.seek(0)
        where = f" (whole log: {self._log})" if self._log else ""
        raise ChildDied(f"{self.label} exited (rc {self._proc.returncode}) {when}{where}:\n{self._err.read()[-3000:]}")


def interleaved_rows(children: Sequence[Child], cells: Sequence[tuple[int, int]], repeats: int) -> list[dict]:
    """For each (context, batch) cell: every child prepares it, then the timed repeats alternate between children
    (the starting child rotates each repeat), then each child reports its row."""
    rows = []
    for context, batch in cells:
        for child in children:
            child.ask(f"cell {context} {batch}")
        for r in range(repeats):
            for i in range(len(children)):
                children[(r + i) % len(children)].ask("repeat")
        rows += [child.row() for child in children]
    return rows


def core_sets(
    count: int, allowed: set[int] | None = None, siblings: dict[int, set[int]] | None = None
) -> list[frozenset[int]]:
    """``count`` disjoint CPU sets of whole physical cores (SMT siblings kept together), as even as the cores allow,
    from ``allowed`` (this process's CPUs): engines pinned apart never share a core with each other. The host speed
    of a batch-1 step moves by up to 1.5 ms between processes, which alternating repeats do not remove."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    siblings = _smt_siblings(allowed) if siblings is None else siblings
    cores = sorted({frozenset(set(siblings.get(c, {c})) & allowed) for c in allowed}, key=min)
    if len(cores) < count:
        raise ValueError(f"pinning needs a physical core per engine: {count} engines, {len(cores)} cores allowed")
    per, extra = divmod(len(cores), count)
    sets, start = [], 0
    for i in range(count):
        end = start + per + (i < extra)
        sets.append(frozenset().union(*cores[start:end]))
        start = end
    return sets


def _smt_siblings(cpus: set[int]) -> dict[int, set[int]]:
    """Each CPU's SMT siblings (itself included) from sysfs; a CPU without topology files is its own core."""
    siblings = {}
    for cpu in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings[cpu] = _cpu_list(path.read_text()) if path.exists() else {cpu}
    return siblings


def _cpu_list(text: str) -> set[int]:
    """sysfs CPU list syntax: ``0-3,8``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus
