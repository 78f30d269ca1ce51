"""A study's grid: its YAML file, and the arms (training runs) it expands to.

    name: cpu_tiny_moe
    base_config: ../configs/tiny_moe.yaml   # relative to this file; every arm starts from it
    base: {max_steps: 300, eval_fraction: 0.05}   # keys every arm sets on top of it
    optimizers:                             # learning rates per optimizer: with several, the sync arms
      adamw: [1.0e-3, 3.0e-3]               # of the first seed pick the best (lowest final validation
      muon: [2.0e-2]                        # loss), and every arm of that optimizer uses it
    modes: [sync, pipedream-2bw, pipedream-2bw@4, pipedream@2, pipedream@4, wpipe]   # schedule[@depth]
    depth: 2                                # of modes written without @ (and sync arms with launch: pipeline)
    ef: [0, 1.0]                            # Error Feedback λ for delayed modes (0: off)
    momentum: [0.9]                         # momentum / beta1
    seeds: [0, 1]
    launch: emulator                        # emulator (one process per arm) or pipeline (torchrun, depth ranks)
    parallel: 2                             # arms run at a time
    output_dir: outputs/study_cpu           # relative to the working directory

An arm is one (optimizer, mode, EF λ, momentum, learning rate, seed). `sync` arms ignore EF (there is
no delay to correct). Every name is checked before anything runs.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

__all__ = ["Arm", "Study", "StudyError", "load_study"]

LAUNCHES = ("emulator", "pipeline")
_KEYS = {"name", "base_config", "base", "optimizers", "modes", "depth", "ef", "momentum", "seeds", "launch",
         "parallel", "output_dir", "threads_per_arm"}


class StudyError(ValueError):
    """A study file that cannot run."""


@dataclass(frozen=True)
class Arm:
    optimizer: str
    schedule: str  # "sync" or an asynchronous schedule's name
    depth: int  # pipeline depth (the emulated one with launch: emulator)
    ef_lambda: float  # 0: Error Feedback off
    momentum: float
    learning_rate: float
    seed: int

    @classmethod
    def from_record(cls, record: dict) -> "Arm":
        """The arm an arm.json record describes."""
        return cls(**record["arm"])

    @property
    def synchronous(self) -> bool:
        return self.schedule == "sync"

    @property
    def mode(self) -> str:
        """The delay mode without optimizer, EF and seed: `sync`, `pipedream-2bw@2`, …"""
        return "sync" if self.synchronous else f"{self.schedule}@{self.depth}"

    @property
    def name(self) -> str:
        ef = f"-ef{self.ef_lambda:g}" if self.ef_lambda else ""
        return f"{self.optimizer}-{self.mode.replace('@', '-p')}{ef}-m{self.momentum:g}-lr{self.learning_rate:g}-s{self.seed}"

    def overrides(self, launch: str) -> dict:
        """Config keys this arm sets (on top of the study's base)."""
        keys = dict(optimizer=self.optimizer, learning_rate=self.learning_rate, momentum=self.momentum,
                    seed=self.seed, ef=bool(self.ef_lambda), ef_lambda=self.ef_lambda or 1.0)
        if launch == "emulator":
            keys.update(pp_size=1, schedule="gpipe" if self.synchronous else self.schedule,
                        emulate_pp_size=0 if self.synchronous else self.depth)
        else:
            keys.update(pp_size=self.depth, schedule="1f1b" if self.synchronous else self.schedule)
        return keys


@dataclass
class Study:
    name: str
    path: Path
    base_config: Path
    base: dict
    learning_rates: dict[str, list[float]]  # per optimizer, in the file's order
    modes: list[tuple[str, int]]  # (schedule or "sync", depth)
    ef_lambdas: list[float]
    momentums: list[float]
    seeds: list[int]
    launch: str = "emulator"
    depth: int = 2  # of modes written without @, and of sync arms with launch: pipeline
    parallel: int = 1
    threads_per_arm: int = 1
    output_dir: Path = field(default_factory=lambda: Path("outputs/study"))

    def arms(self, chosen_lr: dict[str, float]) -> list[Arm]:
        """Every arm, with each optimizer at its chosen learning rate."""
        arms = []
        for optimizer, (schedule, depth), momentum, seed in itertools.product(
                self.learning_rates, self.modes, self.momentums, self.seeds):
            if schedule == "sync" and self.launch == "pipeline":
                depth = self.depth  # a 1F1B pipeline as deep as the delayed arms: the same numerics as one rank
            for ef in ([0.0] if schedule == "sync" else self.ef_lambdas):
                arms.append(Arm(optimizer, schedule, depth, ef, momentum, chosen_lr[optimizer], seed))
        return arms

    def tuning_arms(self) -> list[Arm]:
        """The sync arms (first momentum, first seed) that choose each optimizer's learning rate."""
        depth = self.depth if self.launch == "pipeline" else 1
        return [Arm(opt, "sync", depth, 0.0, self.momentums[0], lr, self.seeds[0])
                for opt, lrs in self.learning_rates.items() if len(lrs) > 1 for lr in lrs]


def _list(values, key: str, kind) -> list:
    values = values if isinstance(values, list) else [values]
    try:
        return [kind(v) for v in values]
    except (TypeError, ValueError):
        raise StudyError(f"study key '{key}' expects {kind.__name__} values, got {values!r}") from None


def _mode(text: str, depth: int) -> tuple[str, int]:
    from ..schedules import SCHEDULES

    schedule, _, at = str(text).partition("@")
    if schedule == "sync":
        return "sync", 1
    spec = SCHEDULES.get(schedule)
    if spec is None or spec.synchronous:
        asynchronous = sorted(n for n, s in SCHEDULES.items() if not s.synchronous)
        raise StudyError(f"unknown mode '{text}': use sync or an asynchronous schedule "
                         f"({', '.join(asynchronous)}), optionally @depth")
    try:
        return schedule, int(at) if at else depth
    except ValueError:
        raise StudyError(f"mode '{text}': the depth after @ must be an integer") from None


def load_study(path: str | os.PathLike) -> Study:
    """Read and check a study file (StudyError with one message)."""
    from ..optim import OPTIMIZER_NAMES

    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study file '{path}' does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise StudyError(f"unknown study key(s): {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    for key in ("base_config", "optimizers", "modes", "seeds"):
        if key not in raw:
            raise StudyError(f"study file '{path}' needs '{key}'")
    base_config = (path.parent / raw["base_config"]).resolve()
    if not base_config.is_file():
        raise StudyError(f"base_config '{raw['base_config']}' (from {path}) does not exist")
    if not isinstance(raw["optimizers"], dict) or not raw["optimizers"]:
        raise StudyError("'optimizers' maps each optimizer to its learning rate(s), e.g. {adamw: [1e-3, 3e-3]}")
    bad = sorted(set(raw["optimizers"]) - set(OPTIMIZER_NAMES))
    if bad:
        raise StudyError(f"unknown optimizer(s) {', '.join(bad)}; available: {', '.join(OPTIMIZER_NAMES)}")
    learning_rates = {opt: _list(lrs, f"optimizers.{opt}", float) for opt, lrs in raw["optimizers"].items()}
    if any(lr <= 0 for lrs in learning_rates.values() for lr in lrs) or not all(learning_rates.values()):
        raise StudyError("every optimizer needs at least one learning rate, all positive")
    depth = int(raw.get("depth", 2))
    modes = [_mode(m, depth) for m in _list(raw["modes"], "modes", str)]
    if not any(s == "sync" for s, _ in modes):
        raise StudyError("'modes' must include sync: gaps are measured against it")
    if any(d < 2 for s, d in modes if s != "sync"):
        raise StudyError("asynchronous modes need a depth of at least 2")
    launch = raw.get("launch", "emulator")
    if launch not in LAUNCHES:
        raise StudyError(f"launch must be one of {', '.join(LAUNCHES)}, got '{launch}'")
    study = Study(
        name=str(raw.get("name", path.stem)), path=path, base_config=base_config, base=dict(raw.get("base") or {}),
        learning_rates=learning_rates, modes=modes, ef_lambdas=_list(raw.get("ef", [0]), "ef", float),
        momentums=_list(raw.get("momentum", [0.9]), "momentum", float), seeds=_list(raw["seeds"], "seeds", int),
        launch=launch, depth=depth, parallel=int(raw.get("parallel", 1)), threads_per_arm=int(raw.get("threads_per_arm", 1)),
        output_dir=Path(raw.get("output_dir", f"outputs/study_{path.stem}")),
    )
    if any(ef < 0 for ef in study.ef_lambdas):
        raise StudyError("ef values are Error Feedback strengths λ >= 0 (0: off)")
    if study.parallel < 1:
        raise StudyError("parallel must be at least 1")
    return study
