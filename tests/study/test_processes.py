"""Stopping a study's arms: a stop signal reaches every running arm as SIGTERM, in a session of its own
(so a terminal's Ctrl-C reaches the study alone), no arm starts after it, and signals the study was
started ignoring (nohup's SIGHUP) stay ignored. Plain Python children stand in for the arms' runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hf_asyncpp.study.processes import ArmProcesses

# Exits with 7 on SIGTERM, as an arm's run ends cleanly after its checkpoint.
_ARM = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
        "print('ready', flush=True); time.sleep(60)")


@pytest.mark.launch
def test_a_stop_sends_sigterm_to_each_running_arm_and_starts_no_more(tmp_path):
    processes, started = ArmProcesses(lambda *_: None), []
    pids, statuses = [], []

    def run_arm(name):
        with open(tmp_path / f"{name}.out", "w") as out:
            statuses.append(processes.run([sys.executable, "-c", _ARM], out, subprocess.DEVNULL, pids.append))

    arms = [threading.Thread(target=run_arm, args=(name,)) for name in ("a", "b")]
    for arm in arms:
        arm.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            (tmp_path / f"{n}.out").is_file() and (tmp_path / f"{n}.out").read_text() for n in ("a", "b")):
        time.sleep(0.02)
    assert all(os.getsid(pid) == pid for pid in pids)  # each leads a session of its own
    processes._stop(signal.SIGTERM, None)
    for arm in arms:
        arm.join(timeout=30)
    assert statuses == [7, 7] and processes.stop_signal == signal.SIGTERM
    assert processes.run([sys.executable, "-c", _ARM], None, None, started.append) is None
    assert started == []  # nothing started


@pytest.mark.launch
def test_an_arm_is_sent_sigterm_once_its_stop_condition_holds_and_the_others_run_on(tmp_path):
    processes = ArmProcesses(lambda *_: None)
    counting = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
                "for i in range(600): print(i, flush=True); time.sleep(0.1)")
    with open(tmp_path / "out", "w") as out:
        start = time.monotonic()
        status = processes.run([sys.executable, "-c", counting], out, subprocess.DEVNULL, lambda pid: None,
                               stop_when=lambda: len((tmp_path / "out").read_text().split()) >= 5)
    assert status == 7 and time.monotonic() - start < 30  # stopped, long before its 60 s
    assert processes.stop_signal is None  # the study itself is not stopping


def test_the_study_takes_the_stop_signals_while_it_runs_and_leaves_ignored_ones_ignored():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    # The start as under `nohup` in a terminal: SIGHUP ignored, the others as Python sets them (a
    # background job of a non-interactive shell inherits SIGINT ignored, so set it explicitly).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        processes = ArmProcesses(lambda *_: None)
        with processes.stopping_on_signals():
            assert signal.getsignal(signal.SIGTERM) == processes._stop
            assert signal.getsignal(signal.SIGINT) == processes._stop
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
