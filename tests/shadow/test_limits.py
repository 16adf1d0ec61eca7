"""Issue 33, items 4-7: the tenant filter, labels that must read back, identities too big
to allocate, and stores that are read-only or full.

Read-only and full filesystems are real: a read-only bind mount and a 256 KiB tmpfs in a
private mount namespace (``unshare -rm``); where user namespaces are not available those
two tests skip, and the sweep's own handling is also checked with a store that refuses
deletes (:class:`_ReadOnlyStore`, the real store behind the real interface).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shadow_testkit import KEY, MEDIUM, SMALL, add_blocks, make_cache

from gpu_cache import Tier
from shadow import (
    CacheShadow,
    CorruptShadowError,
    MeteredStore,
    ShadowConfig,
    ShadowStoreError,
    load_manifest,
    open_store,
    recover_session,
    recover_sessions,
)
from shadow.debris import sweep_debris

MANUAL = ShadowConfig(autostart=False)
REPO = Path(__file__).resolve().parents[2]


def _edit(path, fn):
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_text(json.dumps(doc))


# ---------------------------------------------------------------- 4. the tenant filter
@pytest.mark.parametrize("tenant", ["", "a b", "../x", "a\nb", "x" * 129, 5])
def test_shadow_config_tenant_follows_the_naming_rule(tenant):
    with pytest.raises(ValueError, match="tenant"):
        ShadowConfig(autostart=False, tenant=tenant)


def test_a_filter_that_matches_nothing_never_empties_the_session(store_url):
    cache = make_cache()
    add_blocks(cache, range(10), tenant="alice")
    with CacheShadow(cache, store_url, "s", config=MANUAL) as sh:
        sh.shadow_now()
    typo = ShadowConfig(autostart=False, tenant="alcie")
    with CacheShadow(cache, store_url, "s", config=typo) as sh:
        result = sh.shadow_now()
    assert recover_session(open_store(store_url), "s", make_cache()).blocks == 10
    assert not result.committed and result.generation == 1 and result.num_blocks == 10


def test_a_cache_emptied_on_purpose_commits_an_empty_shadow_when_allowed(store_url):
    """allow_empty: a cache whose last block left (the vLLM store's format pool evicted
    empty) says so in its session, so recovery brings none of those blocks back."""
    cache = make_cache()
    add_blocks(cache, range(10), tenant="alice")
    emptying = ShadowConfig(autostart=False, allow_empty=True)
    with CacheShadow(cache, store_url, "s", config=emptying) as sh:
        sh.shadow_now()
        cache.remove_blocks([m.block_id for m in cache.metadata.all()])
        result = sh.shadow_now()
    assert result.committed and result.generation == 2 and result.num_blocks == 0
    assert recover_session(open_store(store_url), "s", make_cache()).blocks == 0


# ---------------------------------------------------------------- 5. labels read back
BAD_LABELS = {"nul": "a\x00b", "newline": "a\nb", "zero-width": "a\u200bb",
              "too long": "x" * 1025, "lone surrogate": "a\ud800"}


@pytest.mark.parametrize("label", sorted(BAD_LABELS))
def test_a_label_the_reader_refuses_is_never_written_and_costs_no_other_block(label,
                                                                             store_url):
    cache = make_cache()
    add_blocks(cache, range(4), tenant="alice")
    add_blocks(cache, range(10, 12), tenant="bob", source_layer=BAD_LABELS[label])
    with CacheShadow(cache, store_url, "s", config=MANUAL) as sh:
        result = sh.shadow_now()
    assert result.num_blocks == 4 and result.blocks_left_out == 2
    dst = make_cache()
    report = recover_session(open_store(store_url), "s", dst)
    assert report.blocks == 4 and not report.skipped
    assert {m.tenant_slug for m in dst.metadata.all()} == {"alice"}


def test_one_malformed_record_costs_only_that_block(store_url, tmp_path):
    cache = make_cache()
    add_blocks(cache, range(3), tenant="alice")
    add_blocks(cache, range(3, 6), tenant="bob")
    with CacheShadow(cache, store_url, "s", config=MANUAL) as sh:
        sh.shadow_now()
    _edit(tmp_path / "shadow" / "s" / "manifest.json",
          lambda d: d["blocks"][1].update(source_layer="a\u200bb"))
    dst = make_cache()
    report = recover_sessions(open_store(store_url), dst)
    assert report.blocks == 5 and not report.errors
    [skipped] = report.skipped
    assert skipped.index == 1 and "source_layer" in skipped.reason
    assert sorted(m.tenant_slug for m in dst.metadata.all()) == ["alice"] * 2 + ["bob"] * 3


# ---------------------------------------------------------------- 6. identity bounds
def test_a_huge_identity_is_refused_before_anything_is_allocated(store_url, tmp_path, capsys):
    from contextkit.cli.commands import main

    with CacheShadow(make_cache(), store_url, "huge", config=MANUAL) as sh:
        sh.shadow_now()  # an empty session: nothing but the identity to size from

    def grow(doc):
        doc["identity"]["head_dim"] = 65536
        doc["tensors"] = {}

    _edit(tmp_path / "shadow" / "huge" / "manifest.json", grow)
    with pytest.raises(CorruptShadowError, match=r"head_dim.*65536"):
        load_manifest(open_store(store_url), "huge")
    # contextkit recover reports it, and builds no cache for it (no 34 GB rotation)
    code = main(["recover", "--store", store_url, "--no-progress", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and "head_dim" in summary["errors"]["huge"]


def test_recover_refuses_a_verification_cache_larger_than_memory(store_url, tmp_path, capsys):
    """A consistent manifest whose blocks (276 MB each) would need twice this machine's
    available memory."""
    from contextkit.cli.commands import main
    from shadow.cli import available_memory

    one = make_cache()
    add_blocks(one, range(1))
    with CacheShadow(one, store_url, "big", config=MANUAL) as sh:
        sh.shadow_now()
    num_blocks = 2 * available_memory() // (64 * 256 * 64 * 264) + 1

    def grow(doc):
        doc["identity"].update(num_layers=64, num_kv_heads=64, head_dim=256, block_size=256)
        doc["tensors"] = {}
        per = {"k_packed": 64 * 256 * 64 * 128, "k_norms": 64 * 256 * 64 * 4,
               "v_packed": 64 * 256 * 64 * 128, "v_norms": 64 * 256 * 64 * 4}
        record = doc["blocks"][0]
        doc["segments"][0]["num_blocks"] = num_blocks
        doc["blocks"] = [dict(record, key=f"{i:064x}", token_range=[0, 4],
                              offsets={n: i * b for n, b in per.items()})
                         for i in range(num_blocks)]

    _edit(tmp_path / "shadow" / "big" / "manifest.json", grow)
    assert len(load_manifest(open_store(store_url), "big").blocks) == num_blocks
    code = main(["recover", "--store", store_url, "--no-progress", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and "memory" in summary["errors"]["big"]
    assert "--session" in summary["errors"]["big"]


# ---------------------------------------------------------------- 7. read-only and full stores
def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(),
                                      reason="no user namespaces here (unshare -rm)")


def _in_namespace(script: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "tests" / "shadow"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


class _ReadOnlyStore(MeteredStore):
    """The real store on a filesystem that refuses changes (what LocalStore raises there)."""

    def delete(self, key: str) -> None:
        raise ShadowStoreError(f"cannot delete {self.url}/{key}: read-only file system; "
                               "make the store writable")

    def put(self, key, data) -> None:
        raise ShadowStoreError(f"cannot write {self.url}/{key}: read-only file system")


def _session_with_debris(store_url, root: Path) -> None:
    cache = make_cache()
    add_blocks(cache, range(5))
    with CacheShadow(cache, store_url, "s", config=MANUAL) as sh:
        sh.shadow_now()
    (root / "s" / "seg-000009.k_packed.bin").write_bytes(b"left by a killed writer")


def test_the_sweep_reports_what_it_cannot_delete_and_never_aborts(store_url, tmp_path):
    root = tmp_path / "shadow"
    _session_with_debris(store_url, root)
    store = _ReadOnlyStore(open_store(store_url))
    swept = sweep_debris(store, older_than_seconds=0)
    assert swept.deleted == [] and list(swept.not_deleted) == ["s/seg-000009.k_packed.bin"]
    assert "read-only" in swept.not_deleted["s/seg-000009.k_packed.bin"]
    assert recover_session(store, "s", make_cache()).blocks == 5


@needs_namespaces
def test_contextkit_recover_works_on_a_read_only_store(store_url, tmp_path):
    root = tmp_path / "shadow"
    _session_with_debris(store_url, root)
    run = _in_namespace(
        f'mount --bind "{root}" "{root}" && mount -o remount,bind,ro "{root}" && '
        f'exec "{sys.executable}" -m contextkit.cli recover --store "{root}" --no-progress '
        "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["blocks"] == 5 and not summary["errors"]
    assert summary["debris"]["not_deleted"] == 1
    assert "--no-sweep" in run.stdout and "could not delete" in run.stdout
    assert (root / "s" / "seg-000009.k_packed.bin").exists()


_FULL_DISK = """
import sys
from shadow_testkit import MEDIUM, add_blocks, make_cache
from shadow import CacheShadow, ShadowConfig, ShadowStoreError
cache = make_cache(MEDIUM, host_blocks=64)
add_blocks(cache, range(40))  # 40 x 18 KiB: more than the 256 KiB filesystem holds
try:
    with CacheShadow(cache, sys.argv[1], "s", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
except ShadowStoreError as exc:
    print("ShadowStoreError:", exc)
"""


@needs_namespaces
def test_a_full_disk_is_a_shadow_store_error_naming_the_store_and_what_to_do(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    (tmp_path / "full_disk.py").write_text(_FULL_DISK)
    run = _in_namespace(
        f'mount -t tmpfs -o size=256k tmpfs "{mount}" && '
        f'exec "{sys.executable}" full_disk.py "file://{mount}/shadow"', cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith("ShadowStoreError:") and "\n" not in line
    assert f"file://{mount}/shadow" in line and "no space left" in line.lower()
    assert "free" in line  # what to do


def test_identity_bounds_leave_real_models_alone():
    from shadow.manifest import parse_identity

    for identity in (SMALL, MEDIUM):
        assert parse_identity(identity.to_dict()) == identity
    llama_70b = dict(MEDIUM.to_dict(), num_layers=80, num_kv_heads=8, head_dim=128,
                     block_size=16)
    assert parse_identity(llama_70b).num_layers == 80


def test_a_tenant_filtered_shadow_of_an_emptied_cache_keeps_the_host_tier_whole(store_url):
    cache = make_cache()
    add_blocks(cache, range(3), tenant="alice")
    with CacheShadow(cache, store_url, "s",
                     config=ShadowConfig(autostart=False, tenant="alice", auth_key=KEY)) as sh:
        sh.shadow_now()
        cache.remove_blocks([m.block_id for m in cache.metadata.all()])
        assert not sh.shadow_now().committed
    dst = make_cache()
    assert recover_session(open_store(store_url), "s", dst, key=KEY).blocks == 3
    assert dst.num_free(Tier.HOST) + dst.num_used(Tier.HOST) == dst.capacity(Tier.HOST)
