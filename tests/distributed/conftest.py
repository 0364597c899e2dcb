"""The scenario workers' shared launches (tests/distributed/shared_worker.py): one torchrun launch
per world size runs the scenarios of every module of this session that needs them; the first test
that asks for one starts both world sizes' launches, side by side. A module run alone (or a
selection of its tests) launches its own worker only, as before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.shared_worker import PARTS

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "shared_worker.py"


@dataclass
class Launch:
    """One shared torchrun launch: its process (exit code, output) and wall seconds."""
    world: int
    parts: list[str]
    proc: subprocess.CompletedProcess
    seconds: float

    def tail(self) -> str:
        return f"exit code {self.proc.returncode}; stderr tail:\n{self.proc.stderr[-6000:]}"


@dataclass
class Part:
    """One worker's scenarios in a shared launch: its folder OUT/<name>/, as the worker's own launch wrote it."""
    name: str
    out: Path
    launch: Launch

    @property
    def world(self) -> int:
        return self.launch.world

    def exit_codes(self) -> list[int | None]:
        """Per rank: the part's exit code, None where the rank never finished it."""
        paths = [self.out / f"exit_rank{r}.json" for r in range(self.world)]
        return [json.loads(p.read_text())["rc"] if p.is_file() else None for p in paths]

    def seconds(self) -> float | None:
        path = self.out / "exit_rank0.json"
        return json.loads(path.read_text())["seconds"] if path.is_file() else None

    def check(self) -> None:
        """Fail unless every rank finished this part with exit code 0, no scenario left an error file and
        the launch exited cleanly or for another part's failure (what the part's own launch asserted)."""
        codes = self.exit_codes()
        errors = sorted(self.out.glob("*/error_rank*.txt")) + sorted(self.out.glob("error_rank*.txt"))
        detail = "\n".join(e.read_text()[-2000:] for e in errors[:2])
        assert codes == [0] * self.world and not errors and self.exited_cleanly(), \
            f"{self.name} scenarios at world {self.world} failed (exit codes per rank {codes}; shared launch of " \
            f"{self.launch.parts}, {self.launch.tail()}):\n{detail}"

    def exited_cleanly(self) -> bool:
        """The launch's exit code is every part's: another part's failure is its own module's to report."""
        return self.launch.proc.returncode == 0 or self.others_failed()

    def others_failed(self) -> bool:
        """Another part of the same launch failed (its own module reports it)."""
        return any(Part(p, self.out.parent / p, self.launch).exit_codes() != [0] * self.world
                   for p in self.launch.parts if p != self.name)


class SharedLaunches:
    def __init__(self, root: Path, needed: set[str]):
        self.root, self.needed = root, needed
        self.parts: dict[tuple[int, str], Part] = {}

    def part(self, world: int, name: str) -> Part:
        if (world, name) not in self.parts:
            self._launch({w: self._names(w, name if w == world else None) for w in (2, 4)})
        return self.parts[(world, name)]

    def _names(self, world: int, asked: str | None) -> list[str]:
        """The parts the next launch at this world size runs: the one asked for and every needed one
        not run yet, in PARTS's order."""
        started = {p for w, p in self.parts if w == world}
        return [p for p in PARTS if world in PARTS[p][2] and p not in started and (p == asked or p in self.needed)]

    def _launch(self, names_by_world: dict[int, list[str]]) -> None:
        """One launch per world size, both at once: a launch keeps 2 cores only half busy (its
        processes start one after the other, its ranks wait for each other), so the two overlap
        well; they share nothing but the machine."""
        from tests.distributed.test_data_parallel import _env

        env = {**_env(), "PYTHONPATH": f"{_env()['PYTHONPATH']}:{ROOT}"}
        running = []
        for world, names in names_by_world.items():
            if not names:
                continue
            out = Path(self.root) / f"world{world}-{'-'.join(names)}"
            out.mkdir(parents=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   str(WORKER), str(out), *names]
            # Output into files: a pipe that nobody reads while the other launch is awaited would fill up.
            logs = (open(out / "stdout.txt", "w"), open(out / "stderr.txt", "w"))
            proc = subprocess.Popen(cmd, env=env, stdout=logs[0], stderr=logs[1], text=True, start_new_session=True)
            running.append((world, names, out, cmd, proc, logs, time.perf_counter()))
        ended: dict[int, float | None] = {}  # index in running -> wall seconds (None: killed as a hang)
        while len(ended) < len(running):
            time.sleep(0.1)
            for i, (world, names, _, _, proc, _, t0) in enumerate(running):
                if i in ended:
                    continue
                if proc.poll() is not None:
                    ended[i] = time.perf_counter() - t0
                elif time.perf_counter() - t0 > sum(PARTS[p][3] for p in names):
                    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: a hang
                    proc.wait()
                    ended[i] = None
        hangs = []
        for i, (world, names, out, cmd, proc, logs, _) in enumerate(running):
            for f in logs:
                f.close()
            stdout, stderr = ((out / name).read_text() for name in ("stdout.txt", "stderr.txt"))
            if ended[i] is None:
                hangs.append(f"the shared launch of {names} at world {world} did not finish within "
                             f"{sum(PARTS[p][3] for p in names)} s (a hang). stderr tail:\n{stderr[-4000:]}")
                continue
            launch = Launch(world, names, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), ended[i])
            print(f"measured shared launch at world {world} of {names}: {ended[i]:.1f} s")
            for p in names:
                self.parts[(world, p)] = Part(p, out / p, launch)
        if hangs:
            pytest.fail("\n".join(hangs))


@pytest.fixture(scope="session")
def shared_launches(request, tmp_path_factory) -> SharedLaunches:
    """The parts whose modules have a selected test that uses a launch go into the first launch of
    each world size; a part asked for later gets a launch of its own."""
    by_module = {module: part for part, (_, module, _, _) in PARTS.items()}
    needed = {by_module[item.path.name] for item in request.session.items
              if item.path.name in by_module and "shared_launches" in item.fixturenames}
    return SharedLaunches(tmp_path_factory.mktemp("shared_launches"), needed)
