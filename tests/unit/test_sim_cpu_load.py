"""The check's count of what else ran on the cores (``sim/cpu_load.py``), on a /proc made by hand: tasks in state R,
split into ours (descendants of the roots, threads included) and the others'."""

from __future__ import annotations

from pathlib import Path

import sim.cpu_load as cpu_load


def _task(root: Path, pid: int, ppid: int, states: list[str]) -> None:
    (root / str(pid) / "task").mkdir(parents=True)
    (root / str(pid) / "stat").write_text(f"{pid} (py thon) {states[0]} {ppid} 1 1 0\n")
    for i, state in enumerate(states):
        (root / str(pid) / "task" / str(pid + i)).mkdir()
        (root / str(pid) / "task" / str(pid + i) / "stat").write_text(f"{pid + i} (x) {state} {ppid} 1\n")


def test_runnable_tasks_are_split_by_process_tree(tmp_path, monkeypatch):
    _task(tmp_path, 1, 0, ["S"])
    _task(tmp_path, 100, 1, ["R", "R", "S"])  # our root: two runnable threads
    _task(tmp_path, 200, 100, ["S", "R"])  # a child of it (a worker): one
    _task(tmp_path, 300, 1, ["R"])  # another session's process
    _task(tmp_path, 400, 300, ["R", "D"])  # and its child: one runnable, one in disk wait
    (tmp_path / "loadavg").write_text("1.0 1.0 1.0 3/100 400\n")  # not a process
    monkeypatch.setattr(cpu_load, "PROC", tmp_path)
    assert cpu_load.runnable({100}) == (3, 2)
    assert cpu_load.runnable({1}) == (5, 0)
