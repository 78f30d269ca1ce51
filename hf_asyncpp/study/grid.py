"""A study's grid: its YAML file, and the arms (training runs) it expands to.

    name: cpu_tiny_moe
    base_config: ../configs/tiny_moe.yaml   # relative to this file; every arm starts from it
    base: {max_steps: 300, eval_fraction: 0.05}   # keys every arm sets on top of it
    optimizers:                             # learning rates per optimizer: with several, the sync arms
      adamw: [1.0e-3, 3.0e-3]               # of the first seed pick the best (lowest final validation
      muon: [2.0e-2]                        # loss) for each momentum value, and every arm of that
                                            # optimizer and momentum uses it
    modes: [sync, pipedream-2bw, pipedream-2bw@4, pipedream@2, wpipe, pipedream-2bw@2+sync50]
    depth: 2                                # of modes written without @ (and sync arms with launch: pipeline)
    ef: [0, 1.0]                            # Error Feedback λ for delayed modes (0: off)
    ef_modes: [pipedream-2bw, pipedream-2bw@4]  # the delayed modes run at each λ > 0 (default: all of them);
                                            # the others run with EF off only
    momentum: [0.9, 0.95]                   # momentum / beta1
    seeds: [0, 1]
    launch: emulator                        # emulator (one process per arm) or pipeline (torchrun, depth ranks)
    parallel: 2                             # arms run at a time
    checkpoint_steps: 100                   # an arm saves its training state every N steps, and an
                                            # interrupted arm resumes from it (default 0: starts over)
    output_dir: outputs/study_cpu           # relative to the working directory
    lr_protocol: both                       # sync (default): delayed arms reuse the sync pick; per_mode: each
                                            # delayed (optimizer, mode, EF λ, momentum) tunes its own on the
                                            # first seed; both: the two side by side
    per_mode_lr_factors: [0.1, 0.3, 1.0]    # per_mode candidates: the sync pick × each (default)
    lr_extensions: 2                        # a pick at the edge of three or more candidates adds one past
                                            # it, up to this many times per tuned group (default 2)
    lr_tie_tolerance: 0.005                 # candidates this close to the best loss tie; the larger rate wins
    report_steps: [250, 500]                # the gaps along the run, at these evaluation steps (steps.md)

A mode is `sync` or `schedule[@depth][+syncN]`. `+syncN` is the sync-start baseline: the first N steps
run synchronously, then the schedule's delays begin (the `sync_steps` config key); it is a mode of its
own in the results, compared with the sync arm like any delayed mode. N must be below max_steps.

An arm is one (optimizer, mode, EF λ, momentum, learning rate, seed). `sync` arms ignore EF (there is
no delay to correct). Learning rates are chosen per (optimizer, momentum): `Study.tuning_arms()` are
the sync arms of the first seed at every candidate learning rate and every momentum value (none for an
optimizer with one candidate), and `Study.arms(chosen)` gives every arm of an (optimizer, momentum) pair
the learning rate `chosen[(optimizer, momentum)]` (or `chosen[optimizer]` for all its momentum values).
Under the `per_mode` protocol each delayed (optimizer, mode, EF λ, momentum) then tunes its own rate
among the sync pick × `per_mode_lr_factors` (`Study.per_mode_candidates`), on the first seed, and
`Study.arms(chosen, per_mode)` gives its arms that pick (tuning.py holds the rule both tunings use).
Every name is checked before anything runs.

A study that chooses learning rates reports only the seeds that chose none (`Study.reported_seeds`: every
seed but the first, whose arms tune): a rate picked on a seed's held-out loss flatters that seed's
numbers, so the grid's arms, tables and verdicts are the fresh seeds', the tuning seed runs its tuning
arms alone, and such a study needs at least two seeds.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

__all__ = ["Arm", "PROTOCOLS", "Study", "StudyError", "load_study", "mode_name", "round_lr"]

LAUNCHES = ("emulator", "pipeline")
# How delayed arms get their learning rate: the sync arms' pick unchanged, or each delayed mode's own.
PROTOCOLS = ("sync", "per_mode")
_KEYS = {"name", "base_config", "base", "optimizers", "modes", "depth", "ef", "ef_modes", "momentum", "seeds",
         "launch", "parallel", "output_dir", "threads_per_arm", "checkpoint_steps", "lr_protocol",
         "per_mode_lr_factors", "lr_extensions", "lr_tie_tolerance", "report_steps"}


def round_lr(lr: float) -> float:
    """A derived learning rate (a factor of a pick, a step past a candidate) to two significant digits:
    its arm's name and settings then read as written (0.009, not 0.009000000000000001)."""
    return float(f"{lr:.2g}")


class StudyError(ValueError):
    """A study file that cannot run."""


def mode_name(schedule: str, depth: int, sync_steps: int = 0) -> str:
    """A mode as the results name it: `sync`, `schedule@depth`, `schedule@depth+syncN`."""
    if schedule == "sync":
        return "sync"
    return f"{schedule}@{depth}" + (f"+sync{sync_steps}" if sync_steps else "")


@dataclass(frozen=True)
class Arm:
    optimizer: str
    schedule: str  # "sync" or an asynchronous schedule's name
    depth: int  # pipeline depth (the emulated one with launch: emulator)
    ef_lambda: float  # 0: Error Feedback off
    momentum: float
    learning_rate: float
    seed: int
    sync_steps: int = 0  # sync start: the first N steps synchronous (0: delayed from the start)

    @classmethod
    def from_record(cls, record: dict) -> "Arm":
        """The arm an arm.json record describes."""
        return cls(**record["arm"])

    @property
    def synchronous(self) -> bool:
        return self.schedule == "sync"

    @property
    def mode(self) -> str:
        """The delay mode without optimizer, EF and seed: `sync`, `pipedream-2bw@2`, `pipedream-2bw@2+sync100`, …"""
        return mode_name(self.schedule, self.depth, self.sync_steps)

    @property
    def name(self) -> str:
        """Its directory's name. Arms without sync start keep the names they had before sync start existed
        (a rerun finds finished arms by name)."""
        ef = f"-ef{self.ef_lambda:g}" if self.ef_lambda else ""
        mode = self.mode.replace("@", "-p").replace("+sync", "-sync")
        return f"{self.optimizer}-{mode}{ef}-m{self.momentum:g}-lr{self.learning_rate:g}-s{self.seed}"

    def overrides(self, launch: str) -> dict:
        """Config keys this arm sets (on top of the study's base)."""
        keys = dict(optimizer=self.optimizer, learning_rate=self.learning_rate, momentum=self.momentum,
                    seed=self.seed, ef=bool(self.ef_lambda), ef_lambda=self.ef_lambda or 1.0)
        if launch == "emulator":
            keys.update(pp_size=1, schedule="gpipe" if self.synchronous else self.schedule,
                        emulate_pp_size=0 if self.synchronous else self.depth)
        else:
            keys.update(pp_size=self.depth, schedule="1f1b" if self.synchronous else self.schedule)
        if self.sync_steps:
            keys["sync_steps"] = self.sync_steps
        return keys


@dataclass
class Study:
    name: str
    path: Path
    base_config: Path
    base: dict
    learning_rates: dict[str, list[float]]  # per optimizer, in the file's order
    modes: list[tuple[str, int, int]]  # (schedule or "sync", depth, sync_steps)
    ef_lambdas: list[float]
    momentums: list[float]
    seeds: list[int]
    launch: str = "emulator"
    depth: int = 2  # of modes written without @, and of sync arms with launch: pipeline
    parallel: int = 1
    threads_per_arm: int = 1
    checkpoint_steps: int = 0  # an arm's training checkpoints, every N steps (0: none; an interrupted arm starts over)
    output_dir: Path = field(default_factory=lambda: Path("outputs/study"))
    ef_modes: list[tuple[str, int, int]] | None = None  # the delayed modes run at each λ > 0; None: all
    protocols: tuple[str, ...] = ("sync",)  # lr_protocol: ("sync",), ("per_mode",) or both
    per_mode_lr_factors: tuple[float, ...] = (0.1, 0.3, 1.0)
    lr_extensions: int = 2  # candidates a tuned group may add past an edge pick
    # Final losses this close to the best tie, and the largest tied rate is the pick: a difference below the
    # smallest seed spread of a sync arm's final loss in the committed studies (0.005) is no evidence, and of
    # two rates that train equally well the larger moves further per step, the harder test of a delay.
    lr_tie_tolerance: float = 0.005
    report_steps: tuple[int, ...] = ()  # evaluation steps the along-the-run table (steps.py) reads

    @property
    def tuning_seed(self) -> int | None:
        """The seed whose arms choose the learning rates (the first), None when the study chooses none
        (one candidate per optimizer, and no per_mode choice)."""
        per_mode_chooses = "per_mode" in self.protocols and len(set(self.per_mode_lr_factors)) > 1
        return self.seeds[0] if self.sync_groups() or per_mode_chooses else None

    @property
    def reported_seeds(self) -> list[int]:
        """The seeds the tables and verdicts read: every seed but the tuning seed."""
        return [seed for seed in self.seeds if seed != self.tuning_seed]

    @property
    def delayed_groups(self) -> list[tuple[str, tuple[str, int, int], float, float]]:
        """Every delayed (optimizer, mode, EF λ, momentum): what the per_mode protocol tunes a rate for."""
        return [(opt, mode, ef, momentum) for mode in self.modes if mode[0] != "sync"
                for opt in self.learning_rates for momentum in self.momentums for ef in self.mode_ef_lambdas(mode)]

    def per_mode_candidates(self, sync_lr: float) -> list[float]:
        """A delayed group's candidate learning rates: its sync pick times each factor."""
        return sorted({round_lr(sync_lr * factor) for factor in self.per_mode_lr_factors})

    def tuning_arm(self, group: tuple, lr: float) -> Arm:
        """The first seed's arm of a tuned group at `lr`: (optimizer, momentum) tunes a sync arm,
        (optimizer, mode, EF λ, momentum) a delayed one."""
        if len(group) == 2:
            optimizer, momentum = group
            depth = self.depth if self.launch == "pipeline" else 1
            return Arm(optimizer, "sync", depth, 0.0, momentum, lr, self.seeds[0])
        optimizer, (schedule, depth, sync_steps), ef, momentum = group
        return Arm(optimizer, schedule, depth, ef, momentum, lr, self.seeds[0], sync_steps)

    def mode_ef_lambdas(self, mode: tuple[str, int, int]) -> list[float]:
        """The EF λ values a mode runs at: none for sync (no delay to correct), every `ef` value for a
        mode in `ef_modes`, and only λ = 0 for a delayed mode left out of it."""
        if mode[0] == "sync":
            return [0.0]
        if self.ef_modes is None or mode in self.ef_modes:
            return self.ef_lambdas
        return [ef for ef in self.ef_lambdas if ef == 0]

    def main_delayed_mode(self) -> tuple[str, int, int] | None:
        """The delayed mode the study's headline, its optimizer and momentum claims and its momentum figure
        read: PipeDream-2BW (the reference's schedule) at its smallest depth, without a sync start; None
        when the grid does not run 2BW."""
        return min((m for m in self.modes if m[0] == "pipedream-2bw" and not m[2]), default=None)

    def first_learning_rates(self) -> dict[tuple[str, float], float]:
        """Each (optimizer, momentum) at its first candidate learning rate: the pick without tuning."""
        return {(opt, momentum): lrs[0] for opt, lrs in self.learning_rates.items() for momentum in self.momentums}

    def learning_rate(self, chosen_lr: Mapping, optimizer: str, momentum: float) -> float:
        """The learning rate `chosen_lr` gives (optimizer, momentum): keyed by the pair, or by the
        optimizer alone for all its momentum values."""
        if (optimizer, momentum) in chosen_lr:
            return chosen_lr[(optimizer, momentum)]
        if optimizer in chosen_lr:
            return chosen_lr[optimizer]
        raise StudyError(f"no learning rate chosen for {optimizer} at momentum {momentum:g}")

    def arms(self, chosen_lr: Mapping, per_mode: Mapping | None = None) -> list[Arm]:
        """Every arm of the reported seeds (the tuning seed runs only its tuning arms: nothing reads its
        others), each (optimizer, momentum) at its chosen learning rate (see `learning_rate`), a
        delayed group in `per_mode` ((optimizer, mode, EF λ, momentum) → rate) at its own, in
        the order a grid run in parts wants: first the first reported seed's, mode by mode in the file's order
        (one look at every mode, every optimizer at a mode before any runs the next); then the other
        seeds' mode by mode, every seed of a mode before the next mode, so the claims about the first
        modes get their seed spread (and their t-test verdicts) before the later modes run."""
        arms, reported = [], self.reported_seeds
        for seeds, (schedule, depth, sync_steps) in [(reported[:1], mode) for mode in self.modes] + \
                [(reported[1:], mode) for mode in self.modes]:
            if schedule == "sync" and self.launch == "pipeline":
                depth = self.depth  # a 1F1B pipeline as deep as the delayed arms: the same numerics as one rank
            for optimizer, momentum, seed in itertools.product(self.learning_rates, self.momentums, seeds):
                lr = self.learning_rate(chosen_lr, optimizer, momentum)
                for ef in self.mode_ef_lambdas((schedule, depth, sync_steps)):
                    own = (per_mode or {}).get((optimizer, (schedule, depth, sync_steps), ef, momentum), lr)
                    arms.append(Arm(optimizer, schedule, depth, ef, momentum, own, seed, sync_steps))
        return arms

    def sync_groups(self) -> dict[tuple[str, float], list[float]]:
        """The (optimizer, momentum) pairs whose sync arms choose a learning rate, with their
        candidates; none for an optimizer with a single candidate."""
        return {(opt, momentum): lrs for opt, lrs in self.learning_rates.items() if len(lrs) > 1
                for momentum in self.momentums}

    def tuning_arms(self) -> list[Arm]:
        """The sync arms (first seed, every momentum value) at the file's candidates."""
        return [self.tuning_arm(group, lr) for group, lrs in self.sync_groups().items() for lr in lrs]


def _list(values, key: str, kind) -> list:
    values = values if isinstance(values, list) else [values]
    try:
        return [kind(v) for v in values]
    except (TypeError, ValueError):
        raise StudyError(f"study key '{key}' expects {kind.__name__} values, got {values!r}") from None


def _mode(text: str, depth: int) -> tuple[str, int, int]:
    """(schedule or "sync", depth, sync_steps) of `sync` or `schedule[@depth][+syncN]`."""
    from ..schedules import SCHEDULES

    text = str(text)
    head, plus, start = text.partition("+")
    sync_steps = 0
    if plus:
        if not (start.startswith("sync") and start[4:].isdigit() and int(start[4:]) > 0):
            raise StudyError(f"mode '{text}': what follows + must be syncN, N > 0 synchronous steps "
                             "before the delays begin, e.g. pipedream-2bw@2+sync100")
        sync_steps = int(start[4:])
    schedule, _, at = head.partition("@")
    if schedule == "sync":
        if plus or at:
            raise StudyError(f"mode '{text}': sync takes neither @depth nor +syncN")
        return "sync", 1, 0
    spec = SCHEDULES.get(schedule)
    if spec is None or spec.synchronous:
        asynchronous = sorted(n for n, s in SCHEDULES.items() if not s.synchronous)
        raise StudyError(f"unknown mode '{text}': use sync or an asynchronous schedule "
                         f"({', '.join(asynchronous)}), optionally @depth and +syncN")
    try:
        return schedule, int(at) if at else depth, sync_steps
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
    if not any(s == "sync" for s, _, _ in modes):
        raise StudyError("'modes' must include sync: gaps are measured against it")
    if any(d < 2 for s, d, _ in modes if s != "sync"):
        raise StudyError("asynchronous modes need a depth of at least 2")
    if len(set(modes)) < len(modes):
        raise StudyError(f"'modes' lists a mode twice: {raw['modes']!r}")
    launch = raw.get("launch", "emulator")
    if launch not in LAUNCHES:
        raise StudyError(f"launch must be one of {', '.join(LAUNCHES)}, got '{launch}'")
    study = Study(
        name=str(raw.get("name", path.stem)), path=path, base_config=base_config, base=dict(raw.get("base") or {}),
        learning_rates=learning_rates, modes=modes, ef_lambdas=_list(raw.get("ef", [0]), "ef", float),
        momentums=_list(raw.get("momentum", [0.9]), "momentum", float), seeds=_list(raw["seeds"], "seeds", int),
        launch=launch, depth=depth, parallel=int(raw.get("parallel", 1)), threads_per_arm=int(raw.get("threads_per_arm", 1)),
        checkpoint_steps=int(raw.get("checkpoint_steps", 0)), output_dir=Path(raw.get("output_dir", f"outputs/study_{path.stem}")),
    )
    if "ef_modes" in raw:
        study.ef_modes = [_mode(m, depth) for m in _list(raw["ef_modes"], "ef_modes", str)]
        stray = [m for m, parsed in zip(_list(raw["ef_modes"], "ef_modes", str), study.ef_modes)
                 if parsed not in modes or parsed[0] == "sync"]
        if stray:
            raise StudyError(f"ef_modes lists {', '.join(stray)}, not a delayed mode in 'modes'")
        if 0 not in study.ef_lambdas and any(m not in study.ef_modes for m in modes if m[0] != "sync"):
            raise StudyError("a delayed mode left out of ef_modes runs with EF off only, so 'ef' must include 0")
    protocol = raw.get("lr_protocol", "sync")
    if protocol not in (*PROTOCOLS, "both"):
        raise StudyError(f"lr_protocol must be one of {', '.join(PROTOCOLS)}, both; got '{protocol}'")
    study.protocols = PROTOCOLS if protocol == "both" else (protocol,)
    study.per_mode_lr_factors = tuple(_list(raw.get("per_mode_lr_factors", [0.1, 0.3, 1.0]),
                                            "per_mode_lr_factors", float))
    if not study.per_mode_lr_factors or any(f <= 0 for f in study.per_mode_lr_factors):
        raise StudyError("per_mode_lr_factors are positive factors of the sync pick, e.g. [0.1, 0.3, 1.0]")
    study.lr_extensions = int(raw.get("lr_extensions", 2))
    if study.lr_extensions < 0:
        raise StudyError("lr_extensions must be >= 0 (0: an edge pick is only flagged)")
    if any(ef < 0 for ef in study.ef_lambdas):
        raise StudyError("ef values are Error Feedback strengths λ >= 0 (0: off)")
    study.lr_tie_tolerance = float(raw.get("lr_tie_tolerance", Study.lr_tie_tolerance))
    if study.lr_tie_tolerance < 0:
        raise StudyError("lr_tie_tolerance must be >= 0 (0: only an exact tie goes to the larger rate)")
    study.report_steps = tuple(sorted(set(_list(raw.get("report_steps", []), "report_steps", int))))
    if any(step <= 0 for step in study.report_steps):
        raise StudyError("report_steps are evaluation steps of the run, each > 0")
    if not study.reported_seeds:
        raise StudyError(f"the study chooses learning rates on seed {study.tuning_seed}, and no reported number "
                         "may come from an arm that chose one: list at least one more seed")
    if study.parallel < 1:
        raise StudyError("parallel must be at least 1")
    if study.checkpoint_steps < 0:
        raise StudyError("checkpoint_steps must be >= 0 (0: arms keep no checkpoints)")
    return study
