"""Test-wide environment (offline Hub, a private HF_HOME, quiet transformers — set before any HF import),
and the suite's tiers (docs/testing.md).

`python -m pytest` runs the fast tier: unit and single-process specifications of behaviour. The other
tiers are marked by what a test does, and run with `--all-tiers` (or by name, `-m launch`):

- `multirank`: real gloo ranks of the session's rank pool (tests/ranks.py);
- `launch`: fresh Python processes: train.py, torchrun, accelerate, the SLURM emulation, signals, scripts;
- `package`: the wheel, built and installed in a fresh virtual environment;
- `repo`: the repository itself: README and docs against the code, committed results against their arms.

A fast-tier test sees no rank pool (the session fixture `rank_pool`) and cannot start a process: it
fails saying which marker it needs, so the fast tier stays fast. Each tier has its own timeout per test.
"""

import multiprocessing.process
import os
import subprocess
import sys
import tempfile

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf_asyncpp_test_hf_home_"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Per tier, the seconds one test may take (pytest-timeout): a fast-tier test that takes minutes belongs
# to another tier.
TIMEOUTS = {"fast": 120, "repo": 600, "multirank": 900, "launch": 900, "package": 900}
TIERS = tuple(t for t in TIMEOUTS if t != "fast")


def pytest_addoption(parser):
    parser.addoption("--all-tiers", action="store_true",
                     help="run every tier (multirank, launch, package, repo), not only the fast one")


def tier_of(item) -> str:
    return next((t for t in TIERS if item.get_closest_marker(t)), "fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("timeout"):  # the longest of its tiers'
            tiers = [t for t in TIERS if item.get_closest_marker(t)] or ["fast"]
            item.add_marker(pytest.mark.timeout(max(TIMEOUTS[t] for t in tiers)))
        if tier_of(item) != "fast" and "rank_pool" not in item.fixturenames:
            item.fixturenames.insert(0, "rank_pool")  # first: before any module fixture that trains on it
    if config.getoption("--all-tiers") or config.getoption("markexpr"):
        return
    kept = [item for item in items if tier_of(item) == "fast"]
    deselected = [item for item in items if tier_of(item) != "fast"]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_report_header(config):
    if not (config.getoption("--all-tiers") or config.getoption("markexpr")):
        return "the fast tier only: --all-tiers runs them all (docs/testing.md)"
    return None


def _launches_python(args) -> bool:
    """Whether a command starts Python: an interpreter, a launcher, the CLI, or a shell script."""
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else list(args))]
    if not argv:
        return False
    head = os.path.basename(argv[0])
    script = head in ("bash", "sh") and len(argv) > 1 and argv[1].endswith(".sh")
    return argv[0] == sys.executable or script or head.endswith(".sh") or head.startswith(
        ("python", "torchrun", "accelerate", "hf-asyncpp", "srun", "sbatch"))


@pytest.fixture(scope="session")
def rank_pool():
    """The session's rank processes (tests/ranks.py), given to every marked test before its other
    fixtures (a module fixture may train on them): started by the first run on them, up from test to
    test, closed when the session ends."""
    from hf_asyncpp.parallel.spawn import RankPool
    from tests import ranks

    ranks.pool = RankPool()
    yield ranks.pool
    ranks.pool.close()
    ranks.pool = None


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    """A fast-tier test sees no rank pool and cannot start a Python process: it fails naming the marker it
    needs. (A multi-rank test may also launch: torchrun, where the launcher itself is tested.)"""
    if any(request.node.get_closest_marker(t) for t in TIERS):
        yield
        return
    from tests import ranks

    monkeypatch.setattr(ranks, "pool", None)
    popen, test = subprocess.Popen.__init__, request.node.nodeid

    def refuse_python(self, args, *rest, **kwargs):
        if _launches_python(args):
            raise RuntimeError(f"{test} starts a Python process ({args!r}): mark it @pytest.mark.launch (docs/testing.md)")
        return popen(self, args, *rest, **kwargs)

    def refuse_process(self, *args, **kwargs):
        raise RuntimeError(f"{test} starts a process ({self.name}): mark it @pytest.mark.launch (docs/testing.md)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_python)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse_process)
    yield


# Seconds per test (setup, call and teardown), for the summary of a run beyond the fast tier.
_SECONDS: dict[str, float] = {}
_TIER_OF: dict[str, str] = {}


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_collection_finish(session):
    _TIER_OF.update({item.nodeid: tier_of(item) for item in session.items})


def pytest_terminal_summary(terminalreporter, config):
    """Where a run of several tiers spent its time: each tier's tests and seconds, and the slowest tests
    (docs/testing.md keeps the suite's budget by them)."""
    tiers = {}
    for nodeid, seconds in _SECONDS.items():
        count, total = tiers.get(_TIER_OF.get(nodeid, "fast"), (0, 0.0))
        tiers[_TIER_OF.get(nodeid, "fast")] = (count + 1, total + seconds)
    if len(tiers) < 2:
        return
    terminalreporter.write_sep("=", "time per tier")
    for tier, (count, total) in sorted(tiers.items(), key=lambda kv: -kv[1][1]):
        terminalreporter.write_line(f"{tier:>9}: {count:5d} tests {total:8.0f} s")
    terminalreporter.write_sep("-", "the 25 slowest tests")
    for nodeid, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {_TIER_OF.get(nodeid, 'fast'):>9}  {nodeid}")
