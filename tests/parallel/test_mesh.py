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
