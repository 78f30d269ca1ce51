"""The (pp, dp) device mesh and the process-group lifecycle.

Rank r sits at pp_rank = r // dp, dp_rank = r % dp: the ranks of one pipeline are dp apart, the
replicas of one stage are neighbours (on GPUs, data-parallel traffic stays inside a node).
Backend: gloo on CPU, nccl on CUDA. Training's messages and collectives time out after
comm_timeout_s (a dead or stalled peer), on every group made here (under NCCL, an asynchronous
pipeline's messages between neighbours after IO_TIMEOUT: `link_timeout`); waits on another rank's I/O go
through `io_group`, whose timeout is IO_TIMEOUT. The start (the rendezvous and the default group)
waits up to STARTUP_TIMEOUT for the other ranks, whatever comm_timeout_s says: ranks start at
different times (imports from a shared filesystem, CUDA initialisation, a loaded machine), and a
short comm_timeout_s, chosen to notice a dead peer quickly, must not make the start itself fail.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from ..torch_internals import _abort_process_group, _set_pg_timeout  # behaviour: tests/parallel/test_mesh.py

from .launch import LaunchInfo

__all__ = ["IO_TIMEOUT", "ParallelLayout", "broadcast_from_first_replica", "device_communicators", "free_port",
           "init_parallel", "link_groups",
           "link_timeout", "mesh_coordinates", "shutdown_parallel", "start_communicators"]

IO_TIMEOUT = timedelta(hours=2)  # tokenizing a large corpus on rank 0, hashing a large checkpoint
STARTUP_TIMEOUT = timedelta(minutes=15)  # as long as torchrun waits for a node to join its rendezvous


@dataclass
class ParallelLayout:
    world_size: int
    rank: int
    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    mesh: DeviceMesh
    # All ranks, gloo, with a long timeout: for waits on a rank's I/O (dataset preparation, checkpoint
    # and export writes), which may outlast comm_timeout_s without anything being wrong.
    io_group: object = None
    # This rank's pipeline again, as a second group: evaluation of an asynchronous pipeline runs while
    # training's messages are in flight, and NCCL matches messages by order alone, so the two
    # programs never share a channel.
    eval_pp_group: object = None
    # And a third time: asynchronous stages all-reduce their gradient norms (global clipping) while
    # P2P messages are in flight; on the pipeline's group they would queue in NCCL's order among them.
    norm_pp_group: object = None
    # And on gloo with the I/O timeout: weights gathered as Python objects for an export (NCCL would
    # stage them in GPU memory, pp times the largest on the gathering rank) around the stages' writes.
    io_pp_group: object = None
    # All ranks once more, gloo with the I/O timeout: a checkpoint's writing half (checkpoint/saving.py),
    # whose collectives run on a background thread beside the main thread's on io_group.
    checkpoint_group: object = None
    # How long a collective or message waits for a peer (comm_timeout_s) in the groups made here.
    timeout: timedelta = timedelta(minutes=10)

    @property
    def pp_group(self):
        return self.mesh.get_group("pp")

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_coordinates(rank: int, world_size: int, pp_size: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, dp_size) of `rank`, known before any process group exists."""
    dp_size = world_size // pp_size
    return rank // dp_size, rank % dp_size, dp_size


def init_parallel(launch: LaunchInfo, pp_size: int, timeout_s: float = 600.0) -> ParallelLayout:
    """Process groups for `launch` as a (pp, dp) mesh. Once they are set up (which waits up to
    STARTUP_TIMEOUT for late ranks), every collective and point-to-point operation fails after
    `timeout_s` without its peer (a dead or stalled rank) instead of waiting forever."""
    if not launch.launched:  # plain `python train.py`: a one-rank group keeps one code path
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s)
    startup = max(STARTUP_TIMEOUT, timeout)  # for the rendezvous and the default group's start
    if not dist.is_initialized():  # a front end's framework (accelerate, under Trainer) may have started it
        store, _, _ = next(dist.rendezvous("env://", timeout=startup))
        # A launcher restarting the workers (torchrun --max_restarts) keeps its store, which still holds
        # the previous attempt's addresses: each attempt's group keeps its keys under its own prefix.
        store = dist.PrefixStore(f"hf_asyncpp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        # On GPUs the default group is bound to this rank's device: NCCL then sets its communicator up
        # here, eagerly, and every group made from it after is split off at once (new_group), instead
        # of being set up lazily by its first operation, which may come mid-run.
        dist.init_process_group(backend=backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=startup, **({"device_id": device} if backend == "nccl" else {}))
    pp_rank, dp_rank, dp_size = mesh_coordinates(launch.rank, launch.world_size, pp_size)
    mesh = init_device_mesh(device.type, (pp_size, dp_size), mesh_dim_names=("pp", "dp"))
    replicas = [[p * dp_size + d for p in range(pp_size)] for d in range(dp_size)]
    # Made with the ranks in step (the default group's start has gathered them): gloo's point-to-point
    # messages wait as long as their group was made with, whatever is set later.
    eval_pp_group, _ = dist.new_subgroups_by_enumeration(replicas, timeout=timeout)
    norm_pp_group, _ = dist.new_subgroups_by_enumeration(replicas, timeout=timeout)
    io_backend = _io_backend()
    io_group = dist.new_group(backend=io_backend, timeout=max(IO_TIMEOUT, timeout))
    io_pp_group, _ = dist.new_subgroups_by_enumeration(replicas, timeout=max(IO_TIMEOUT, timeout), backend=io_backend)
    checkpoint_group = dist.new_group(backend=io_backend, timeout=max(IO_TIMEOUT, timeout))
    # Set up: from now on a peer that does not answer within comm_timeout_s is dead or stalled. (The
    # default group was made with the start-up timeout, the mesh's with torch's default; they carry
    # collectives only, which take the timeout set now.)
    _bound_collectives([dist.group.WORLD, mesh.get_group("pp"), mesh.get_group("dp")], timeout)
    return ParallelLayout(
        world_size=launch.world_size,
        rank=launch.rank,
        pp_size=pp_size,
        dp_size=dp_size,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        device=device,
        mesh=mesh,
        io_group=io_group,
        eval_pp_group=eval_pp_group,
        norm_pp_group=norm_pp_group,
        io_pp_group=io_pp_group,
        checkpoint_group=checkpoint_group,
        timeout=timeout,
    )


def _io_backend() -> str:
    """gloo for the I/O groups, whatever the training backend; under a fake process group (a memory
    plan, plan.py: one process plays one rank of the real world size) every group is fake."""
    return "fake" if dist.get_backend() == "fake" else "gloo"


def _bound_collectives(groups, timeout: timedelta) -> None:
    """Make every collective on `groups` fail after `timeout` without its peers."""
    for group in groups if dist.get_backend() != "fake" else ():  # a fake group waits for nothing
        _set_pg_timeout(timeout, group)


def link_timeout(device: torch.device, comm_timeout: timedelta, asynchronous: bool) -> timedelta:
    """How long a message between pipeline neighbours may stay unreceived. gloo times a message from
    when it is waited on; NCCL's watchdog times it from when it is posted. An asynchronous pipeline's
    last sends of a step are received in the next step, after whatever evaluation or checkpoint runs
    between them, so under NCCL they may wait as long as I/O does. The price: a peer that stalls (a
    dead one ends the launch at once) is noticed by a collective queued behind its messages after
    comm_timeout_s where a rank reaches one, else only after IO_TIMEOUT."""
    return max(comm_timeout, IO_TIMEOUT) if device.type == "cuda" and asynchronous else comm_timeout


# This process's pair groups (`link_groups`), in the global order of their pairs: aborted at teardown.
_pair_groups: list[dist.ProcessGroup] = []


def link_groups(layout: ParallelLayout, rank_pairs: list[tuple[int, int]],
                asynchronous: bool = False) -> dict[int, dist.ProcessGroup]:
    """A two-rank process group for each pair of pipeline ranks in `rank_pairs` (pp ranks, every
    replica): peer's global rank → the group this rank's messages with it go on. Call on every rank.

    NCCL runs the batches posted on one communicator one after another on one stream, so on the
    pipeline's group a middle rank's batch with one neighbour would wait behind a batch with the
    other that is still waiting for its data. Each pair on its own communicator keeps them apart:
    the one-stream-per-pair timing of schedules/validate.py."""
    # The ranks come here apart by what they built and loaded: gather them on the I/O group, so that
    # making the groups (each waits for every rank) needs no more than comm_timeout_s.
    dist.barrier(group=layout.io_group)
    links = {}
    for a, b in rank_pairs:  # the same order on every rank: each new_group involves all of them
        for d in range(layout.dp_size):
            ranks = [a * layout.dp_size + d, b * layout.dp_size + d]
            group = dist.new_group(ranks, timeout=link_timeout(layout.device, layout.timeout, asynchronous))
            if layout.rank in ranks:
                links[ranks[1] if ranks[0] == layout.rank else ranks[0]] = group
                _pair_groups.append(group)
    return links


def device_communicators(layout: ParallelLayout) -> int:
    """How many communicators of two or more ranks this rank holds on its device (on GPUs: NCCL
    communicators, each with its buffers): the default group, the pipeline's, dp's, the evaluation's
    and the norms' groups, and the pair groups made here."""
    groups = [dist.group.WORLD, layout.pp_group, layout.dp_group, layout.eval_pp_group, layout.norm_pp_group,
              *_pair_groups]
    return sum(1 for g in groups if g is not None and dist.get_world_size(g) > 1)


def start_communicators(layout: ParallelLayout, rank_pairs: list[tuple[int, int]],
                        asynchronous: bool = False) -> dict[int, dist.ProcessGroup]:
    """Make the pair groups (`link_groups`; none for an empty `rank_pairs`) and set up and use once
    every communicator the run uses, before its first step; returns the pair groups as link_groups
    does. Call once on every rank, before any other operation of the run on these groups.

    Why: NCCL sets a communicator up on its first operation, and connects two ranks of one on their
    first message, unless told otherwise. Both wait for every rank involved and allocate device
    memory. Set up lazily, the first dp gather or statistics all-reduce of a run, or the first
    evaluation's messages, would do it while pipeline messages posted before are still waiting on
    the device, and a set-up that waits behind a spinning kernel, or a kernel that waits for a peer
    blocked in a set-up, hangs the run. Here nothing else is in flight: each group gets one
    collective on its device, each pair of pipeline neighbours exchanges one message in each
    direction on every group the pipeline's messages take, and the default group's device is bound
    at init_parallel, so no communicator is made or connected mid-run.

    One order on every rank: the groups by kind (I/O, default, pp, dp, evaluation, norm, I/O pp, checkpoint),
    then the pairs of neighbours in the global order of their ranks. Groups of one kind are
    disjoint, and a rank waits on a pair only once every earlier pair of its own is done: no rank
    can wait on a peer that waits on something later."""
    links = link_groups(layout, rank_pairs, asynchronous) if rank_pairs else {}
    device, cpu = layout.device, torch.device("cpu")
    groups = [(layout.io_group, cpu), (dist.group.WORLD, device), (layout.pp_group, device), (layout.dp_group, device),
              (layout.eval_pp_group, device), (layout.norm_pp_group, device), (layout.io_pp_group, cpu),
              (layout.checkpoint_group, cpu)]
    for group, on in groups:
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=on), group=group)
    dp = layout.dp_size
    pairs = sorted((a * dp + d, b * dp + d) for a, b in rank_pairs for d in range(dp))
    for low, high in pairs:
        if layout.rank not in (low, high):
            continue
        peer = high if layout.rank == low else low
        # The pipeline's own groups carry batched messages (an evaluation's, a schedule without pair
        # groups'); torch's stages send nothing at start-up (their metadata is static, models/stage_io.py).
        # Training's messages take the pair's own group.
        for group in (layout.pp_group, layout.eval_pp_group):
            _exchange(group, peer, device)
        if peer in links:
            _exchange(links[peer], peer, device)
    return links


def _exchange(group, peer: int, device: torch.device) -> None:
    """One message to `peer` and one from it on `group`, as one batch (NCCL groups the two, so neither
    end waits for the other's order)."""
    mine, theirs = torch.zeros(1, device=device), torch.empty(1, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                        dist.P2POp(dist.irecv, theirs, peer, group)]):
        work.wait()


@torch.no_grad()
def broadcast_from_first_replica(modules: list[torch.nn.Module], layout: ParallelLayout) -> None:
    """Make every dp replica of these (unsharded) modules hold dp rank 0's parameters and buffers."""
    if layout.dp_size == 1:
        return
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, group=layout.dp_group, group_src=0)


def shutdown_parallel(peers_alive: bool = True) -> None:
    """Tear the process groups down. The pair groups (`link_groups`) are aborted, not destroyed:
    destroying a group waits for its pending operations (NCCL finalizes the communicator), and an
    asynchronous pipeline that did not end its run (SIGTERM, a failure) leaves sends no step will
    receive. They are aborted after the final barrier, when every peer has received all it ever
    will, one pair after another in one global order (were an abort to wait for the peer's, as in
    some NCCL versions, no two ranks would wait on each other). After a failure (`peers_alive`
    False) there is no final barrier: a dead or stopped peer would keep it waiting until the timeout."""
    if dist.is_initialized():
        if peers_alive:
            dist.barrier()  # gloo sometimes aborts when a peer tears down mid-collective
        for group in _pair_groups:
            _abort_process_group(group)
        dist.destroy_process_group()
    _pair_groups.clear()
