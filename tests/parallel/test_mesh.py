"""The (pp, dp) mesh's groups: each pair of neighbouring pipeline ranks gets its own two-rank group,
in every replica, and messages on it reach the peer."""

from __future__ import annotations

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
