"""The (pp, dp) mesh's groups: each pair of neighbouring pipeline ranks gets its own two-rank group,
in every replica, and messages on it reach the peer; the start waits for late ranks, and afterwards
every group's operations wait comm_timeout_s for a peer."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from tests.ranks import run_ranks


def _links(rank, world_size, pp_size, rank_pairs):
    import torch
    import torch.distributed as dist

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, link_groups, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        links = link_groups(layout, rank_pairs)
        received = {}
        for peer, group in sorted(links.items()):
            mine, theirs = torch.tensor([float(rank)]), torch.zeros(1)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                                dist.P2POp(dist.irecv, theirs, peer, group)]):
                work.wait()
            received[peer] = (sorted(dist.get_process_group_ranks(group)), theirs.item())
        return received
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size, rank_pairs, expected", [
    # pp 4, stages in a line: ranks 0-1, 1-2, 2-3.
    (4, [(0, 1), (1, 2), (2, 3)], [{1}, {0, 2}, {1, 3}, {2}]),
    # pp 4, two stages per rank in a loop: the last rank also sends to the first.
    (4, [(0, 1), (0, 3), (1, 2), (2, 3)], [{1, 3}, {0, 2}, {1, 3}, {0, 2}]),
    # pp 2 × dp 2: rank r is (pp r // 2, dp r % 2); each replica's two ranks are linked.
    (2, [(0, 1)], [{2}, {3}, {0}, {1}]),
])
def test_each_pair_of_neighbouring_ranks_talks_on_a_group_of_its_own(pp_size, rank_pairs, expected):
    reports = run_ranks(4, _links, pp_size, rank_pairs)
    for rank, received in enumerate(reports):
        assert set(received) == expected[rank], rank
        for peer, (group_ranks, value) in received.items():
            assert group_ranks == sorted((rank, peer)) and value == peer


def _timeouts_after_a_late_start(rank, world_size, late_rank, late_s, comm_timeout_s):
    import time

    import torch
    import torch.distributed as dist

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, link_groups, shutdown_parallel

    if rank == late_rank:
        time.sleep(late_s)  # a slow import, a loaded node
    layout = init_parallel(read_launch(), 2, timeout_s=comm_timeout_s)
    try:
        (link,) = link_groups(layout, [(0, 1)]).values()
        groups = {"world": dist.group.WORLD, "pp": layout.pp_group, "dp": layout.dp_group, "eval": layout.eval_pp_group,
                  "norm": layout.norm_pp_group, "link": link, "io": layout.io_group}
        # What each group's operations wait for a peer (the backend's own setting).
        return {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name, group in groups.items()}
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_a_rank_starting_later_than_comm_timeout_s_joins_and_then_every_group_waits_only_comm_timeout_s():
    """comm_timeout_s (2 s here) bounds training's waits for a dead or stalled peer, on every group the
    mesh makes (the dp group of pp 2 × dp 2 included); it does not bound the start, where one rank
    arriving 5 s after the others is normal."""
    from hf_asyncpp.parallel.mesh import IO_TIMEOUT

    reports = run_ranks(4, _timeouts_after_a_late_start, 3, 5.0, 2.0)
    for report in reports:
        assert report == {"world": 2.0, "pp": 2.0, "dp": 2.0, "eval": 2.0, "norm": 2.0, "link": 2.0,
                          "io": IO_TIMEOUT.total_seconds()}


_ALL_REDUCE_WITH_A_LATE_PEER = """
import datetime, sys, time
import torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(minutes=30))
group = dist.new_group([0, 1])
dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2), group)
start = time.monotonic()
if rank == 0:
    try:
        dist.all_reduce(torch.ones(1), group=group)
        print("returned", time.monotonic() - start)
    except RuntimeError:
        print("failed", time.monotonic() - start)
else:
    time.sleep(8)  # never joins the all-reduce
"""


@pytest.mark.multirank
def test_torch_private_set_pg_timeout_bounds_the_collectives_of_a_gloo_group_made_with_a_longer_one():
    """Pins `torch.distributed.distributed_c10d._set_pg_timeout`, which init_parallel uses to give the
    default group (made with the start-up timeout) and the mesh's groups (torch's default) comm_timeout_s
    for training: a collective whose peer never comes fails after the new timeout (2 s), not after the
    one the group was made with (30 min)."""
    import subprocess
    import sys

    from hf_asyncpp.parallel.mesh import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", _ALL_REDUCE_WITH_A_LATE_PEER, str(rank), port],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    outcome, seconds = outputs[0].split()
    assert outcome == "failed" and 1.5 < float(seconds) < 6, outputs[0]


@pytest.mark.parametrize("device, asynchronous, expected", [
    ("cuda", True, "io"), ("cuda", False, "comm"), ("cpu", True, "comm"), ("cpu", False, "comm"),
])
def test_an_asynchronous_pipelines_nccl_messages_may_wait_across_an_evaluation_or_checkpoint(device, asynchronous,
                                                                                           expected):
    """NCCL's watchdog times a message from its posting, and an asynchronous pipeline's last sends of a
    step wait for the next step, past any evaluation or checkpoint between them: under NCCL its links
    wait as long as I/O may (IO_TIMEOUT). gloo times the wait itself, and a synchronous pipeline's
    messages are all received within their step: comm_timeout_s."""
    from datetime import timedelta

    import torch

    from hf_asyncpp.parallel.mesh import IO_TIMEOUT, link_timeout

    comm = timedelta(seconds=600)
    assert link_timeout(torch.device(device), comm, asynchronous) == (IO_TIMEOUT if expected == "io" else comm)
    assert link_timeout(torch.device(device), IO_TIMEOUT * 2, asynchronous) == IO_TIMEOUT * 2  # never shorter


@contextmanager
def group_teardowns(links):
    """Records {(which, how)} for every group torch tears down inside the block: which is "link" for
    the groups in `links`, else "another group"; how is "aborted" or "destroyed"."""
    import torch.distributed as dist

    link_names = {group.group_name for group in links}
    ended = set()
    process_group = dist.ProcessGroup
    # The class's own entries: read through the class, pybind's methods come back unbound, and set back
    # so they would no longer bind to the group.
    abort, shutdown = vars(process_group)["abort"], vars(process_group)["shutdown"]

    def spy(how, method):
        def ended_by(group, *args):
            ended.add(("link" if group.group_name in link_names else "another group", how))
            return method.__get__(group)(*args)
        return ended_by

    process_group.abort, process_group.shutdown = spy("aborted", abort), spy("destroyed", shutdown)
    try:
        yield ended
    finally:
        process_group.abort, process_group.shutdown = abort, shutdown


def _teardown_with_a_send_never_received(rank, world_size):
    import torch
    import torch.distributed as dist

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, link_groups, shutdown_parallel

    layout = init_parallel(read_launch(), 2)
    (link,) = link_groups(layout, [(0, 1)], asynchronous=True).values()
    with group_teardowns([link]) as ended:
        if rank == 0:  # the activation of a step that never runs: no receive is ever posted for it
            dist.isend(torch.ones(1 << 20), 1, group=link)
        shutdown_parallel()
    return ended


@pytest.mark.multirank
def test_pair_groups_are_aborted_at_teardown_even_with_a_send_never_received_and_the_others_destroyed():
    """Destroying a group waits for its pending operations (NCCL finalizes the communicator), and a
    send whose step never runs never completes: the pair groups, which carry the pipeline's messages,
    are aborted instead (torch's private `_abort_process_group`, pinned here: it ends the group through
    `ProcessGroup.abort` and takes it out of what `destroy_process_group` then tears down)."""
    for report in run_ranks(2, _teardown_with_a_send_never_received):
        assert report == {("link", "aborted"), ("another group", "destroyed")}


# What a rank does on a group: the ProcessGroup methods torch's collectives and messages call.
_GROUP_OPERATIONS = ("allreduce", "allreduce_coalesced", "barrier", "broadcast", "allgather", "_allgather_base",
                     "allgather_into_tensor_coalesced", "allgather_coalesced", "reduce", "reduce_scatter",
                     "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "gather", "scatter", "alltoall",
                     "alltoall_base", "send", "recv", "recv_anysource", "monitored_barrier")


@contextmanager
def group_uses():
    """Records every operation on a process group inside the block: yields (uses, phase), uses a list
    of (phase[0] at the time, the group's name), in order."""
    import torch.distributed as dist

    uses, phase = [], ["init"]
    process_group = dist.ProcessGroup
    methods = {name: vars(process_group)[name] for name in _GROUP_OPERATIONS if name in vars(process_group)}

    def spy(method):
        def used(group, *args, **kwargs):
            uses.append((phase[0], group.group_name))
            return method.__get__(group)(*args, **kwargs)
        return used

    for name, method in methods.items():
        setattr(process_group, name, spy(method))
    try:
        yield uses, phase
    finally:
        for name, method in methods.items():
            setattr(process_group, name, method)


def _first_uses(rank, world_size, schedule):
    """pp 2 × dp 2: the engine's start-up, then three steps with an evaluation after the first, and
    their end; per phase, the groups used, and the groups that exist."""
    import importlib

    import torch
    import torch.distributed as dist

    import hf_asyncpp.engine as engine_module
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.test_engine import small_model_config

    def groups():
        return sorted(group.group_name for group in dist.distributed_c10d._world.pg_map)

    with group_uses() as (uses, phase):
        layout = init_parallel(read_launch(), 2)
        try:
            # Every executor starts its communicators first thing (executors/*.py: start_communicators).
            executor_modules = [importlib.import_module(f"hf_asyncpp.executors.{kind}")
                                for kind in ("synchronous", "asynchronous", "emulated")]
            starting = executor_modules[0].start_communicators

            def start(*args, **kwargs):
                phase[0] = "start-up"
                try:
                    return starting(*args, **kwargs)
                finally:
                    phase[0] = "engine"

            for module in executor_modules:
                module.start_communicators = start
            try:
                model_config = small_model_config("tiny-qwen3-moe")
                config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=2, schedule=schedule, optimizer="adamw",
                                     learning_rate=3e-3, seq_len=8, micro_batch_size=1, n_microbatches=2, seed=4,
                                     max_steps=3, max_grad_norm=1.0, grad_clip_scope="global")
                engine = engine_module.PipelineEngine(config, model_config, layout)
            finally:
                for module in executor_modules:
                    module.start_communicators = starting
            after_start_up = groups()
            phase[0] = "steps"
            rows = [torch.randint(0, model_config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(k))
                    for k in range(4)]
            for k in range(3):
                engine.train_step(rows[k], rows[k + 1] if engine.forwards_ahead and k < 2 else None)
                if k == 0:
                    engine.eval_step(rows[3])
            engine.finish()
            return uses, after_start_up, groups()
        finally:
            phase[0] = "teardown"
            shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["pipedream-2bw", "1f1b"])
def test_every_group_is_made_and_used_once_at_start_up_in_one_order_on_every_rank(schedule):
    """NCCL sets a communicator up on its first operation (and connects two ranks on their first
    message), waiting for its peers and allocating device memory: done mid-run, behind pipeline
    messages still in flight, it can hang. So on pp 2 × dp 2 every group the run has is made before
    its first step and first used inside the engine's start-up (mesh.start_communicators), no group is
    made after it (not by the steps, their statistics, global clipping, an evaluation amid an
    asynchronous pipeline's messages, nor the end), and the ranks use the groups they share for the
    first time in the same order."""
    reports = run_ranks(4, _first_uses, schedule)
    first_uses = []
    for rank, (uses, after_start_up, at_end) in enumerate(reports):
        assert at_end == after_start_up, f"rank {rank} made groups after start-up"
        first = {}
        for phase, group in uses:
            first.setdefault(group, phase)
        late = {group: phase for group, phase in first.items() if phase != "start-up"}
        assert not late, f"rank {rank}: groups first used outside the start-up: {late}"
        assert set(first) == set(at_end), f"rank {rank}: groups never used at start-up: {set(at_end) - set(first)}"
        assert {group for phase, group in uses if phase == "steps"}, "the steps used no group"
        first_uses.append(list(first))
    for a in range(4):
        for b in range(a + 1, 4):
            shared = set(first_uses[a]) & set(first_uses[b])
            assert ([g for g in first_uses[a] if g in shared] == [g for g in first_uses[b] if g in shared]), (a, b)


def test_on_gpus_the_default_group_is_bound_to_the_ranks_device(monkeypatch):
    """With a device_id, NCCL sets the default group's communicator up at init_process_group and
    splits every later group off it at once, rather than making each on its first operation; gloo
    (CPU) takes none."""
    import torch
    import torch.distributed as dist

    from hf_asyncpp.parallel import mesh
    from hf_asyncpp.parallel.launch import LaunchInfo

    class Started(Exception):
        pass

    seen = {}

    def init_process_group(**kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: iter([(dist.HashStore(), 3, 4)]))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    launch = LaunchInfo(world_size=4, rank=3, local_rank=1, launched=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(Started):
        mesh.init_parallel(launch, 2)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    seen.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Started):
        mesh.init_parallel(launch, 2)
    assert seen["backend"] == "gloo" and "device_id" not in seen
