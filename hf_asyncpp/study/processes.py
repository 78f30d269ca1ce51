"""The arms' processes while a study runs, and stopping them.

SIGTERM, SIGINT or SIGHUP to the study (a scheduler's time limit, Ctrl-C, a closed terminal) sends
SIGTERM to every running arm, which saves a checkpoint at its next step boundary and exits
(resilience.py); no further arm starts, and a rerun of the study resumes the stopped arms. Arms run in
sessions of their own so that a terminal's Ctrl-C reaches the study alone and they stop this way, not
by a KeyboardInterrupt that would lose their steps since the last checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Callable

from ..resilience import signals_handled

__all__ = ["ArmProcesses", "StudyStopped"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StudyStopped(Exception):
    """The study was stopped by a signal after its running arms saved their checkpoints."""


class ArmProcesses:
    """Starts arms and, once a stop signal arrived, stops the running ones and starts no more."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.stop_signal: int | None = None
        self._running: set[subprocess.Popen] = set()
        # Re-entrant: a second signal may arrive while the main thread runs the handler of the first.
        self._lock = threading.RLock()

    def stopping_on_signals(self):
        """While active, the stop signals stop the study (a signal ignored from the start, as nohup's
        SIGHUP or a background job's SIGINT, stays ignored)."""
        return signals_handled(self._stop, *_STOP_SIGNALS)

    def _stop(self, signum, frame) -> None:
        with self._lock:
            if self.stop_signal is None:
                self.log(f"study: {signal.Signals(signum).name}: the running arms save a checkpoint at their next "
                         "step and stop; no further arm starts")
            self.stop_signal = signum
            for process in self._running:
                process.send_signal(signal.SIGTERM)

    def run(self, command: list[str], out, err, started: Callable[[int], None],
            stop_when: Callable[[], bool] | None = None) -> int | None:
        """Run an arm's command to its end and return its exit status; `started(pid)` is called once it
        runs, and once `stop_when()` (asked four times a second) is true the arm is sent SIGTERM, as on a stop
        signal. None, and nothing run, once the study is stopping."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its log lines as they happen
        with self._lock:
            if self.stop_signal is not None:
                return None
            process = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
            self._running.add(process)
        try:
            started(process.pid)
            if stop_when is not None:
                while process.poll() is None:
                    if stop_when():
                        process.send_signal(signal.SIGTERM)
                        break
                    time.sleep(0.25)
            return process.wait()
        finally:
            with self._lock:
                self._running.discard(process)
