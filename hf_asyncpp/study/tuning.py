"""Choosing learning rates, one rule for every tuned group.

A group is what shares a learning rate: an (optimizer, momentum) pair, tuned on its sync arms, or under
the per_mode protocol a delayed (optimizer, mode, EF λ, momentum), tuned on its own arms among the
sync pick × `per_mode_lr_factors`. Each group's arms of the first seed run at every candidate, and the
one with the lowest final validation loss is its pick; candidates within the study's `lr_tie_tolerance` of
that loss tie, and the largest tied rate is the pick (tuning.json marks the tied ones). The tuning seed's
arms choose and are not reported (grid.py: `Study.reported_seeds`). A pick at the smallest or largest of three or
more candidates may have its optimum beyond them: the group adds a candidate one step past it (the
step between the two outermost candidates on that side, on a log scale), up to `lr_extensions` times,
and a pick still at the edge after that is flagged `at_edge` in tuning.json.

Candidates past the file's are derived from finished results only, so a study stopped part-way and
rerun continues the same tuning. tuning.json records every trial and pick; the report reads the picks
from the finished arms by the same rule (so a report while tuning runs shows the best so far).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from .grid import Arm, Study, StudyError, mode_name, round_lr
from .runner import finished_record, run_arms

__all__ = ["Picks", "TUNING", "candidates", "per_mode_picks", "sync_picks", "tied", "tune", "write_tuning"]

TUNING = "tuning.json"

Group = tuple  # (optimizer, momentum) or (optimizer, mode, EF λ, momentum)


def tied(losses: dict[float, float], tolerance: float) -> list[float]:
    """The learning rates whose final validation loss is within `tolerance` of the lowest, in order."""
    if not losses:
        return []
    best = min(losses.values())
    return sorted(lr for lr, loss in losses.items() if loss - best <= tolerance)


def candidates(listed: list[float], losses: dict[float, float], extensions: int, tolerance: float) -> list[float]:
    """The group's candidates: the listed ones, and one more past an edge pick for each extension
    whose predecessors have all finished (`losses`: the finished ones' final validation losses; the pick
    is the largest of those tied within `tolerance` of the best)."""
    lrs = sorted(listed)
    for _ in range(extensions):
        if len(lrs) < 3 or any(lr not in losses for lr in lrs):
            break
        best = max(tied({lr: losses[lr] for lr in lrs}, tolerance))
        if best == lrs[0]:
            lrs.insert(0, round_lr(lrs[0] ** 2 / lrs[1]))
        elif best == lrs[-1]:
            lrs.append(round_lr(lrs[-1] ** 2 / lrs[-2]))
        else:
            break
    return lrs


class Picks:
    """Each group's trials (learning rate → final validation loss of its finished first-seed arm), its
    candidates, and its pick (None before any trial finished)."""

    def __init__(self, study: Study, listed: dict[Group, list[float]]):
        self.tie_tolerance = study.lr_tie_tolerance
        self.trials: dict[Group, dict[float, float]] = {}
        self.candidates: dict[Group, list[float]] = {}
        for group, lrs in listed.items():
            losses: dict[float, float] = {}
            # Finished candidates may extend the list, whose new members may have finished too.
            while True:
                current = candidates(lrs, losses, study.lr_extensions, study.lr_tie_tolerance)
                for lr in current:
                    record = finished_record(study, study.tuning_arm(group, lr))
                    if record is not None:
                        losses[lr] = record["final_eval"]["eval_loss"]
                if candidates(lrs, losses, study.lr_extensions, study.lr_tie_tolerance) == current:
                    break
            self.trials[group], self.candidates[group] = losses, current

    def tied(self, group: Group) -> list[float]:
        """The finished candidates within the tie tolerance of the group's best loss."""
        return tied(self.trials.get(group) or {}, self.tie_tolerance)

    def pick(self, group: Group) -> float | None:
        return max(self.tied(group), default=None)

    def at_edge(self, group: Group) -> bool:
        """The pick is the smallest or largest of three or more candidates, all finished."""
        lrs = self.candidates[group]
        return (len(lrs) >= 3 and all(lr in self.trials[group] for lr in lrs)
                and self.pick(group) in (lrs[0], lrs[-1]))

    def chosen(self) -> dict[Group, float]:
        return {group: lr for group in self.candidates if (lr := self.pick(group)) is not None}

    def unfinished_arms(self, study: Study) -> list[Arm]:
        return [study.tuning_arm(group, lr) for group, lrs in self.candidates.items() for lr in lrs
                if lr not in self.trials[group]]

    def record(self) -> list[dict]:
        return [dict(_fields(group), learning_rate=lr, eval_loss=loss, chosen=lr == self.pick(group),
                     tied=lr in self.tied(group), at_edge=lr == self.pick(group) and self.at_edge(group))
                for group, losses in self.trials.items() for lr, loss in sorted(losses.items())]


def _fields(group: Group) -> dict:
    if len(group) == 2:
        return dict(optimizer=group[0], momentum=group[1])
    return dict(optimizer=group[0], mode=mode_name(*group[1]), ef_lambda=group[2], momentum=group[3])


def sync_picks(study: Study) -> Picks:
    return Picks(study, study.sync_groups())


def per_mode_picks(study: Study, sync_chosen: dict[tuple[str, float], float]) -> Picks:
    """The delayed groups' picks, each among its sync pick × the study's factors."""
    return Picks(study, {group: study.per_mode_candidates(study.learning_rate(sync_chosen, group[0], group[3]))
                         for group in study.delayed_groups})


def tune(study: Study, picks_of: Callable[[], Picks], log, alongside: list[Arm] = ()) -> Picks:
    """Run a tuning's arms (finished ones are skipped), with `alongside` (arms that do not wait for it)
    in the first round, then each round's new candidates, until no group adds one; every group must
    then have a pick. An arm that failed is not tried again in the same study run."""
    tried: set[str] = set()
    batch = list({arm.name: arm for arm in [*picks_of().unfinished_arms(study), *alongside]}.values())
    while batch:
        tried.update(arm.name for arm in batch)
        run_arms(study, batch, log)
        batch = [arm for arm in picks_of().unfinished_arms(study) if arm.name not in tried]
    picks = picks_of()
    missing = [group for group in picks.candidates if picks.pick(group) is None]
    if missing:
        raise StudyError(f"every learning-rate trial of {_fields(missing[0])} failed (see {study.output_dir / 'arms'})")
    for group in picks.candidates:
        if picks.at_edge(group):
            end = "largest" if picks.pick(group) == picks.candidates[group][-1] else "smallest"
            log(f"study: warning: {_fields(group)}: the best learning rate, {picks.pick(group):g}, is still the {end} "
                f"of its candidates after {study.lr_extensions} extension(s): the optimum may lie beyond them")
    return picks


def write_tuning(study: Study, sync: Picks, per_mode: Picks | None) -> None:
    """tuning.json: every trial, pick and edge flag, per protocol."""
    record = {"format": 4, "tie_tolerance": study.lr_tie_tolerance, "tuning_seed": study.tuning_seed, "sync": sync.record(), "per_mode": per_mode.record() if per_mode else []}
    (study.output_dir / TUNING).write_text(json.dumps(record, indent=1))
