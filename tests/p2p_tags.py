"""Record the tag and the process group of every pipeline message a rank posts.

The runtime sends every message untagged (tag 0), so gloo matches them by posting order per pair of
ranks, as NCCL does: the equality suites (pipeline ≡ HF model, pipeline ≡ emulator) then also prove
that no result depends on tags. `recording()` makes that visible to their checks. Training's
messages also go on a group of just the two ranks (parallel/mesh.link_groups): under NCCL one
communicator runs its batches on one stream, so each pair of ranks gets its own.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def recording():
    """Yields a dict {"tags": set of tags seen, "ops": count of P2P operations posted, "channels": set
    of (the ranks of the message's group, its two ranks)}."""
    import torch.distributed as dist

    seen = {"tags": set(), "ops": 0, "channels": set()}
    original = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        seen["tags"].update(op.tag for op in p2p_op_list)
        seen["ops"] += len(p2p_op_list)
        seen["channels"].update((tuple(sorted(dist.get_process_group_ranks(op.group))),
                                 tuple(sorted((dist.get_rank(), op.peer)))) for op in p2p_op_list)
        return original(p2p_op_list)

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield seen
    finally:
        dist.batch_isend_irecv = original


def assert_untagged(seen: dict) -> None:
    assert seen["ops"] > 0, "no pipeline message was posted"
    assert seen["tags"] == {0}, f"messages carried tags {sorted(seen['tags'])}: NCCL ignores them"


def assert_each_pair_on_its_own_group(seen: dict) -> None:
    assert seen["ops"] > 0, "no pipeline message was posted"
    shared = sorted(group for group, pair in seen["channels"] if group != pair)
    assert not shared, f"messages went on groups {shared}, shared by more than the two ranks of a message"
