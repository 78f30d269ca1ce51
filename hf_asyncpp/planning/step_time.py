"""Each schedule's step at a run's layout, predicted: the timing model (schedules/play.py, what the checker
and the slowdown warnings use) played on costs from the stages' FLOPs and bytes on an assumed device.

Per stage and microbatch (`stage_costs`):
  - compute: the training FLOPs of the microbatch's tokens (utilization.py, PaLM's count: 6 × the
    parameters a token touches, plus attention), a third each for the forward, the input gradient and the
    weight gradient; full activation checkpointing adds a forward to the backward. Seconds = FLOPs over
    the device's peak × its MFU;
  - the optimizer step: OPTIMIZER_BYTES per stored parameter read and written at the device's memory
    bandwidth (once per update);
  - a message: a microbatch's activations (or their gradient) in the compute dtype, over the link.

Not in the step: dp's gradient reduction and weight gathering (FSDP), the data and host work, kernels
slower than the MFU says (MoE routing, small GEMMs); benchmarks/schedule_sleep.py measures the model
against the real runtime on sleeping stages.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "OPTIMIZER_BYTES", "SCHEDULES", "StageCost", "clips_globally", "fastest_fitting", "predict_step",
           "predict_steps", "stage_costs", "step_table"]

SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv", "pipedream-2bw", "wpipe", "pipedream")
# An optimizer step per stored parameter (AdamW, fp32): reads the master weight, its gradient and two
# moments, writes the weight and the moments.
OPTIMIZER_BYTES = 28


@dataclass(frozen=True)
class Device:
    """What the prediction assumes of each GPU and of the links between pipeline ranks. Defaults: an
    H100 SXM (bf16 dense tensor-core peak, HBM3 bandwidth) at 40% MFU, and 400 Gb/s InfiniBand between
    nodes (applied to every message: within a node NVLink is faster)."""

    peak_tflops: float = 989.0
    mfu: float = 0.4
    memory_tbs: float = 3.35
    link_gbs: float = 50.0

    def compute_s(self, flops: float) -> float:
        return flops / (self.peak_tflops * 1e12 * self.mfu)


@dataclass(frozen=True)
class StageCost:
    """Seconds per microbatch (forward, input gradient, weight gradient) and per update (optimizer)."""

    forward_s: float
    input_gradient_s: float
    weight_gradient_s: float
    optimizer_s: float


def stage_costs(config, model_config, n_stages: int, device: Device, stage_boundaries=None) -> list[StageCost]:
    """Each of `n_stages` stages' costs, cut as the run cuts them (config.stage_balance, or
    `stage_boundaries` when they are for this many stages)."""
    from ..models import plan_stages
    from ..models.split import layer_costs
    from ..utilization import attention_flops_per_token

    plan = plan_stages(model_config, n_stages, config.stage_balance, stage_boundaries)
    # the parameters a token touches per layer and in the LM head and final norm (the embedding's lookup
    # touches none), and those each stores (the embedding on the first stage)
    touched, _, head_touched = layer_costs(model_config, "compute")
    stored, embedding, head_stored = layer_costs(model_config, "params")
    tokens = config.micro_batch_size * config.seq_len
    costs = []
    for s, layers in enumerate(plan):
        last = s == n_stages - 1
        active = sum(touched[i] for i in layers) + (head_touched if last else 0.0)
        flops = tokens * (6.0 * active + attention_flops_per_token(model_config, len(layers), config.seq_len))
        third = device.compute_s(flops / 3)
        recompute = third if config.activation_checkpointing == "full" else 0.0
        held = sum(stored[i] for i in layers) + (embedding if s == 0 else 0.0) + (head_stored if last else 0.0)
        costs.append(StageCost(third, third + recompute, third, OPTIMIZER_BYTES * held / (device.memory_tbs * 1e12)))
    return costs


def message_s(config, model_config, device: Device) -> float:
    """A microbatch's activations between two stages, in the compute dtype a GPU run takes, over the link."""
    import torch

    from ..parallel.fsdp import compute_dtype

    dtype = compute_dtype(config.mixed_precision, torch.device("cuda"), config.fsdp) or torch.float32
    values = config.micro_batch_size * config.seq_len * model_config.hidden_size
    return values * dtype.itemsize / (device.link_gbs * 1e9)


def predict_step(spec, pp_size: int, n_microbatches: int, costs: list[StageCost], clip_globally: bool = False,
                 link_s: float = 0.0, transport: str = "nccl") -> tuple[float, float]:
    """(step, bubble-free limit) in seconds of schedule `spec` once its pipeline is full, stage s costing
    costs[s] and each message `link_s` over `transport` (ScheduleSpec.steady_step: the timing model)."""
    from ..torch_internals import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, REDUCE_GRAD

    def cost(rank, action) -> float:
        c = costs[action.stage_index]
        return {FORWARD: c.forward_s, FULL_BACKWARD: c.input_gradient_s + c.weight_gradient_s,
                BACKWARD_INPUT: c.input_gradient_s, BACKWARD_WEIGHT: c.weight_gradient_s,
                REDUCE_GRAD: c.optimizer_s}.get(action.computation_type, 0.0)

    return spec.steady_step(pp_size, n_microbatches, cost, clip_globally=clip_globally, link_s=link_s,
                            transport=transport)


def clips_globally(spec, pp_size: int, n_microbatches: int, wanted: bool) -> bool:
    """Whether schedule `spec` clips by the global norm at this size: a synchronous one always (its stages
    wait for each other anyway), an asynchronous one if `wanted` and its order can wait for every stage's
    norm there (WPipe's cannot: it clips by stage)."""
    from ..schedules import ScheduleError

    if spec.synchronous or not wanted:
        return spec.synchronous
    try:
        spec.check_microbatches(pp_size, n_microbatches, clip_globally=True)
    except (ValueError, ScheduleError):
        return False
    return True


def predict_steps(config, model_config, world_size: int, device: Device = Device(),
                  schedules: tuple[str, ...] = SCHEDULES) -> list[dict]:
    """One record per schedule at the config's layout (pp_size, n_microbatches, world_size / pp_size
    replicas): its predicted step and bubble-free limit (seconds), tokens per second and how it clips, or
    why it cannot run there (`refused`)."""
    from ..schedules import ScheduleError, get_schedule_spec

    pp, m, dp = config.pp_size, config.n_microbatches, world_size // config.pp_size
    link_s = message_s(config, model_config, device)
    records = []
    for name in schedules:
        spec = get_schedule_spec(name)
        clip = config.max_grad_norm > 0 and clips_globally(spec, pp, m, config.clips_by_global_norm)
        record = {"schedule": name}
        try:
            spec.check_microbatches(pp, m)
            n_stages = spec.n_stages(pp)
            boundaries = config.stage_boundaries if config.stage_boundaries and \
                len(config.stage_boundaries) == n_stages - 1 else None
            costs = stage_costs(config, model_config, n_stages, device, boundaries)
            step, limit = predict_step(spec, pp, m, costs, clip, link_s)
        except (ValueError, ScheduleError) as err:
            records.append(record | {"refused": str(err).strip().splitlines()[0]})
            continue
        tokens = m * config.micro_batch_size * config.seq_len * dp
        records.append(record | {"clipping": "global" if clip else ("stage" if config.max_grad_norm > 0 else "none"),
                                 "step_s": step, "limit_s": limit, "tokens_per_s": tokens / step})
    return records


def fastest_fitting(records: list[dict], fits: dict[str, bool]) -> dict | None:
    """The record of the fastest schedule whose memory was played and fits (`fits`: schedule → whether
    every rank fits), or None."""
    fitting = [r for r in records if "step_s" in r and fits.get(r["schedule"])]
    return min(fitting, key=lambda r: r["step_s"], default=None)


def step_table(records: list[dict], fits: dict[str, bool]) -> str:
    """Markdown: one row per schedule, its predicted step beside the bubble-free limit, its tokens/s and
    whether its memory fits (played for the schedules in `fits`)."""
    best = fastest_fitting(records, fits)
    rows = ["| schedule | clipping | step ms | bubble-free ms | step / bubble-free | tokens/s | memory |",
            "|---|---|---:|---:|---:|---:|---|"]
    for r in records:
        if "refused" in r:
            rows.append(f"| {r['schedule']} | | | | | | refused: {r['refused'][:90]} |")
            continue
        memory = {True: "fits", False: "does not fit", None: "not played"}[fits.get(r["schedule"])]
        mark = " **fastest that fits**" if r is best else ""
        rows.append(f"| {r['schedule']} | {r['clipping']} | {1000 * r['step_s']:.0f} | {1000 * r['limit_s']:.0f} | "
                    f"{r['step_s'] / r['limit_s']:.3f} | {r['tokens_per_s']:,.0f} | {memory}{mark} |")
    return "\n".join(rows)
