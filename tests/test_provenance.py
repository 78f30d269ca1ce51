"""What a result records about the code that produced it: the commit of the git checkout the package
runs from (marked when its tracked files are edited, absent outside a checkout), the software
versions, and the machine."""

from __future__ import annotations

import subprocess

import torch
import transformers

from hf_asyncpp.provenance import machine, software_versions, source_commit


def _git(directory, *args):
    return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_commit_is_the_checkouts_head_marked_when_tracked_files_are_edited(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    (tmp_path / "outside.py").write_text("z = 3\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert source_commit(package) == head

    (package / "new.py").write_text("y = 2\n")  # untracked: not part of what ran from the commit's files
    (tmp_path / "outside.py").write_text("z = 4\n")  # tracked, but not the package's
    assert source_commit(package) == head
    (package / "a.py").write_text("x = 2\n")
    assert source_commit(package) == head + "+modified"


def test_outside_a_checkout_there_is_no_commit(tmp_path):
    assert source_commit(tmp_path) is None


def test_the_versions_are_the_ones_imported_and_the_machine_has_cores():
    versions = software_versions()
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    facts = machine()
    assert facts["cores"] >= 1 and facts["cpu"]
    assert facts["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()  # e.g. AVX2 or AVX512
