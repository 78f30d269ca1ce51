"""The tests' recorder of host reads: the package's own (hf_asyncpp/planning/host_reads.py), recording
every tensor, since on CPU every tensor stands for a device one."""

from __future__ import annotations

import contextlib

from hf_asyncpp.planning.host_reads import READS, HostRead, HostReads

__all__ = ["READS", "HostRead", "host_reads_recorded"]


@contextlib.contextmanager
def host_reads_recorded():
    """Every Python-level host read of a tensor inside the block is in the list yielded, with its call
    site; the read itself is done as usual."""
    with HostReads(all_tensors=True) as reads:
        yield reads.records
