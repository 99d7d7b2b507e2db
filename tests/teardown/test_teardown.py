"""tiered_ops.teardown_cli end to end: fake pulumi CLI on PATH, the ARM double, Azurite as the archive.

What an operator depends on: the file system goes only when Blob provably holds every committed
checkpoint; a refusal changes nothing and says exactly what is missing; a failed step stops
before anything is deleted; a re-run after an interruption continues; --dry-run changes nothing.
"""
from __future__ import annotations

import pathlib
from datetime import timedelta

import pytest

from .conftest import ACCOUNT, STACK, Env, archived_ckpts, later, now

COME_BACK = f"pulumi config set tiered:computeEnabled true --stack {STACK} && pulumi up --stack {STACK}"


def test_gate_passes_then_disable_config_up_in_order_and_prints_how_to_come_back(env: Env) -> None:
    names = archived_ckpts(env)
    r = env.run("--yes")
    assert r.rc == 0, r.err
    # The order that matters: export stopped before the stack config changes, config before up.
    changes = [e for e in env.events if e in ("disable-autoexport", "pulumi config set tiered:computeEnabled false", "pulumi up --yes")]
    assert changes == ["disable-autoexport", "pulumi config set tiered:computeEnabled false", "pulumi up --yes"]
    assert env.arm_changes() == ["autoexport.patch:Disable"]
    assert env.arm.scenario.autoexport["state"] == "Disabled"
    # The stack now keeps only the archive side.
    out = env.outputs()
    assert out["computeEnabled"] is False and out["amlfsName"] is None
    assert out["storageAccountName"] == ACCOUNT and out["dataContainer"] == env.container
    # Where the checkpoints are and how to come back, exactly.
    assert f"storage account {ACCOUNT}, container {env.container}, prefix /checkpoints/" in r.out
    assert f"newest {names[-1]}" in r.out
    assert COME_BACK in r.out and "tiered-ckpt restore --latest" in r.out
    assert "Removed: file system fs1 with auto-export job job1" in r.out
    assert env.journal()["completed"]
    # Nothing in Blob was touched.
    assert all(n.startswith("checkpoints/llama/") for n in env.blobs())


def test_json_result_has_plan_gate_and_come_back(env: Env) -> None:
    archived_ckpts(env, 1)
    r = env.run("--yes", "--json")
    assert r.rc == 0, r.err
    res = r.json()
    assert res["ok"] is True and res["gate"]["ok"] is True
    assert [s["step"] for s in res["plan"]] == ["outputs", "gate", "disable-autoexport", "config", "up"]
    assert res["archive"]["storageAccountName"] == ACCOUNT and res["archive"]["checkpointPrefix"] == "/checkpoints"
    assert res["come_back"][0] == COME_BACK
    assert res["removed"]["amlfsName"] == "fs1"


def test_dry_run_prints_every_step_and_changes_nothing(env: Env) -> None:
    archived_ckpts(env)
    r = env.run("--dry-run")
    assert r.rc == 0, r.err
    # Reads only: the outputs, and the lifecycle settings the report dates the archive's tiering by.
    assert env.mutating() == [] and env.commands() == ["stack output", "config get", "config get"]
    assert env.arm_changes() == []
    for cmd in (f"pulumi stack output --json --stack {STACK}", f"pulumi config set tiered:computeEnabled false --stack {STACK}",
                f"pulumi preview --diff --stack {STACK}", f"pulumi up --yes --stack {STACK}", '"adminStatus": "Disable"'):
        assert cmd in r.flat, cmd
    assert "gate: PASS" in r.flat and "nothing was changed" in r.flat
    assert not (env.journal_dir / f"{STACK}.json").exists() or not env.journal()["steps"]


def _lustre_only_checkpoint(env: Env) -> str:
    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30)           # committed on Lustre, never exported
    env.last_success(later())
    return f"llama/{d.name}"


def _wrong_size(env: Env) -> str:
    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30)
    env.archive(d)
    env.put_blob(f"checkpoints/llama/{d.name}/rank1.bin", b"x" * 100)
    env.last_success(later())
    return f"llama/{d.name}/rank1.bin"


def _failed_files(env: Env) -> str:
    archived_ckpts(env)
    env.arm.scenario.autoexport["totalFilesFailed"] = 3
    return "failed files (total 3"


def _stale(env: Env) -> str:
    archived_ckpts(env)
    env.last_success(now() - timedelta(hours=1))
    return "not after the newest checkpoint"


def _not_in_progress(env: Env) -> str:
    archived_ckpts(env)
    env.arm.scenario.autoexport["state"] = "Failed"
    return "auto-export is Failed"


@pytest.mark.parametrize("make, kind, lustre", [
    (_lustre_only_checkpoint, "checkpoint-missing", True),
    (_wrong_size, "file-size", True),
    (_failed_files, "export-failed-files", False),
    (_stale, "export-stale", False),
    (_not_in_progress, "export-state", False),
])
def test_gate_refuses_for_each_reason_and_changes_nothing(env: Env, make, kind, lustre) -> None:
    what = make(env)
    extra = ["--lustre-root", str(env.mount)] if lustre else []
    r = env.run("--yes", "--json", *extra)
    assert r.rc == 1, r.err
    res = r.json()
    assert res["ok"] is False and res["refused"] is True
    problems = res["gate"]["problems"]
    assert [p["kind"] for p in problems] == [kind]
    assert what in problems[0]["message"] or what == problems[0]["checkpoint"] or what.endswith(str(problems[0]["file"]))
    assert what in res["error"] or what.split("/")[-1] in res["error"]
    # Nothing changed: no ARM write, no pulumi config/up.
    assert env.arm_changes() == []
    assert env.mutating() == []
    assert env.outputs()["amlfsName"] == "fs1"


def test_wrong_size_names_expected_and_found(env: Env) -> None:
    _wrong_size(env)
    r = env.run("--yes", "--lustre-root", str(env.mount))
    assert r.rc == 1
    assert "rank1.bin: 100 bytes in Blob, the manifest says 3000" in r.flat
    assert "nothing was removed" in r.flat


def test_blob_only_evidence_is_said_and_catches_a_missing_file(env: Env) -> None:
    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30)
    env.archive(d)
    from azure.storage.blob import ContainerClient

    ContainerClient.from_connection_string(env.conn, env.container).delete_blob(f"checkpoints/llama/{d.name}/rank0.bin")
    r = env.run("--yes", "--json")
    assert r.rc == 1
    res = r.json()
    assert any("Lustre not scanned" in e for e in res["gate"]["evidence"])
    assert [(p["kind"], p["file"]) for p in res["gate"]["problems"]] == [("file-missing", "rank0.bin")]


def test_blob_only_gate_waits_for_iterations_that_started_after_it_began(env: Env) -> None:
    archived_ckpts(env)
    env.arm.scenario.iterate_on_get = False          # auto-export stuck: no new iteration completes
    r = env.run("--yes", "--json")
    assert r.rc == 1
    assert [p["kind"] for p in r.json()["gate"]["problems"]] == ["export-stale"]
    assert "started after this teardown began" in r.json()["gate"]["problems"][0]["message"]
    assert env.mutating() == [] and env.arm_changes() == []
    # With Lustre scanned too: a checkpoint committed just before the teardown may not be exported
    # yet, and only an iteration that started after the teardown began has walked it.
    r = env.run("--yes", "--json", "--lustre-root", str(env.mount))
    assert r.rc == 1
    assert [p["kind"] for p in r.json()["gate"]["problems"]] == ["export-stale"]
    assert env.mutating() == [] and env.arm_changes() == []
    env.arm.scenario.iterate_on_get = True           # iterations resume: the wait ends
    r = env.run("--yes", "--lustre-root", str(env.mount))
    assert r.rc == 0, r.flat


def test_disable_failed_stops_before_any_pulumi_change(env: Env) -> None:
    archived_ckpts(env)
    env.arm.scenario.disable_result = "DisableFailed"
    r = env.run("--yes")
    assert r.rc == 3
    assert "DisableFailed" in r.flat and "Nothing was removed" in r.flat
    assert env.mutating() == []
    # A half-done disable is undone: export must not stay off for a teardown that did not happen.
    assert env.arm.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert "auto-export was re-enabled" in r.flat
    assert env.outputs()["amlfsName"] == "fs1"


def test_disable_refused_by_arm_changes_nothing(env: Env) -> None:
    archived_ckpts(env)
    env.arm.scenario.deny = {"autoexport.patch"}
    r = env.run("--yes")
    assert r.rc == 2
    assert "autoExportJobs/write" in r.flat and "Nothing was removed" in r.flat
    assert env.mutating() == [] and env.arm.scenario.autoexport["state"] == "InProgress"


def test_interrupted_up_rerun_continues_without_redoing_steps(env: Env) -> None:
    archived_ckpts(env)
    env.fail_next("up", exit=255, stderr="error: update failed: context canceled")
    r1 = env.run("--yes")
    assert r1.rc == 1
    assert "Re-run the same command to continue" in r1.flat and "context canceled" in r1.flat
    assert "\"adminStatus\": \"Enable\"" in r1.flat                # the way back names the re-enable
    steps = env.journal()["steps"]
    assert {"autoexport_disabled", "config_set"} <= set(steps) and "up_done" not in steps
    assert env.outputs()["amlfsName"] == "fs1"          # pulumi did not finish

    r2 = env.run("--yes")
    assert r2.rc == 0, r2.err
    assert "continuing an interrupted teardown" in r2.flat
    assert "already Disabled" in r2.flat
    assert env.arm.kinds("autoexport.patch") == ["autoexport.patch:Disable"]   # not disabled twice, never re-enabled
    assert env.commands().count("up") == 2
    assert env.outputs()["computeEnabled"] is False
    assert COME_BACK in r2.out

    # A third run after completion converges (compute already off) without touching ARM.
    before = len(env.arm.requests)
    r3 = env.run("--yes")
    assert r3.rc == 0, r3.err
    assert "already gone" in r3.flat and len(env.arm.requests) == before


def test_rerun_after_the_file_system_is_gone(env: Env) -> None:
    archived_ckpts(env)
    env.fail_next("up", exit=137, stderr="Killed", apply=False)
    assert env.run("--yes").rc == 1
    env.arm.filesystem = "deleted-by-the-interrupted-up"    # ARM now answers 404 for fs1
    r = env.run("--yes")
    assert r.rc == 0, r.err
    assert "nothing is left on Lustre" in r.flat
    assert env.outputs()["computeEnabled"] is False


def test_missing_file_system_without_our_journal_refuses(env: Env) -> None:
    archived_ckpts(env)
    env.arm.filesystem = "someone-else"
    r = env.run("--yes", "--json")
    assert r.rc == 1
    assert [p["kind"] for p in r.json()["gate"]["problems"]] == ["export-missing"]
    assert env.mutating() == []
    # Knowing it is gone, --force (typed stack name) goes ahead without trying to disable a missing job.
    r = env.run("--yes", "--force", stdin=f"{STACK}\n")
    assert r.rc == 0, r.err
    assert "not found; nothing to disable" in r.flat and env.arm_changes() == []


def test_force_needs_the_typed_stack_name(env: Env) -> None:
    _failed_files(env)
    r = env.run("--yes", "--force", stdin="staging\n")
    assert r.rc == 1 and "not the stack name 'prod'" in r.flat
    assert env.mutating() == [] and env.arm_changes() == []
    r = env.run("--yes", "--force", stdin="")
    assert r.rc == 1 and env.mutating() == []
    r = env.run("--yes", "--force", stdin=f"{STACK}\n")
    assert r.rc == 0, r.err
    assert "LOST" in r.flat
    assert env.commands()[-2:] == ["up", "stack output"]


def test_without_yes_the_preview_is_shown_and_declining_undoes_everything(env: Env) -> None:
    archived_ckpts(env)
    r = env.run(stdin="y\nn\n")
    assert r.rc == 1
    # The preview ran after the config change, so it shows the compute side going.
    assert "Previewing update (prod)" in r.flat and "output amlfsName (delete)" in r.flat
    assert "up" not in env.commands()
    assert env.stacks()[STACK]["config"] == {}                     # restored: it was unset before
    assert env.arm.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert env.arm.scenario.autoexport["state"] == "InProgress"
    assert "not confirmed; nothing was removed" in r.flat


def test_ordinary_confirmation_declined_changes_nothing(env: Env) -> None:
    archived_ckpts(env)
    r = env.run(stdin="n\n")
    assert r.rc == 1 and env.mutating() == [] and env.arm_changes() == []


def test_manual_export_archives_after_disabling_auto_export(env: Env) -> None:
    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30)                      # not exported; auto-export behind
    env.last_success(now() - timedelta(minutes=5))
    env.arm.scenario.archive_hook = env.archive_hook()
    r = env.run("--yes", "--manual-export", "--lustre-root", str(env.mount))
    assert r.rc == 0, r.err
    kinds = env.arm.kinds()
    # One blob job at a time: check running jobs, disable, then archive the checkpoint prefix.
    i_list, i_dis, i_arch = kinds.index("imports.get"), kinds.index("autoexport.patch:Disable"), kinds.index("archive.post")
    assert i_list < i_dis < i_arch
    assert env.arm.requests[i_arch].body == {"filesystemPath": "/checkpoints"}
    assert kinds.count("autoexport.patch:Disable") == 1
    assert f"checkpoints/llama/{d.name}/rank0.bin" in env.blobs()
    assert "manual export of /checkpoints: Completed 100%" in r.flat
    assert env.outputs()["computeEnabled"] is False


def test_manual_export_that_fails_refuses_and_re_enables_auto_export(env: Env) -> None:
    archived_ckpts(env, 1)
    env.write_ckpt(2, 30)
    env.last_success(now() - timedelta(minutes=5))
    env.arm.scenario.archive_result = "Failed"
    r = env.run("--yes", "--json", "--manual-export", "--lustre-root", str(env.mount))
    assert r.rc == 1
    res = r.json()
    assert {p["kind"] for p in res["gate"]["problems"]} >= {"archive-failed", "checkpoint-missing"}
    assert "auto-export was re-enabled" in res["error"]
    assert env.arm.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert env.mutating() == []


def test_waits_with_progress_until_the_export_catches_up(env: Env) -> None:
    import threading
    import time

    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30)

    def export_later() -> None:
        time.sleep(0.5)
        env.archive(d)
        env.last_success(later())

    t = threading.Thread(target=export_later)
    t.start()
    try:
        r = env.run("--yes", "--lustre-root", str(env.mount), "--wait-timeout", "20s", "--poll-interval", "0.2s")
    finally:
        t.join()
    assert r.rc == 0, r.err
    assert "waiting for the archive:" in r.flat and "in Blob" in r.flat


def test_delete_archive_is_separate_and_needs_the_typed_account_name(env: Env) -> None:
    archived_ckpts(env)
    r = env.run("delete-archive", stdin=f"{ACCOUNT}\n")
    assert r.rc == 1 and "tear it down first" in r.flat and env.mutating() == []

    assert env.run("--yes").rc == 0
    n = len(env.mutating())
    r = env.run("delete-archive", "--yes", stdin="nope\n")          # --yes never replaces the typed name
    assert r.rc == 1 and "nothing was deleted" in r.flat
    assert len(env.mutating()) == n and env.stacks()[STACK].get("destroyed") is None

    r = env.run("delete-archive", "--dry-run", "--json")
    assert r.rc == 0 and len(env.mutating()) == n
    res = r.json()
    assert res["deletes"]["storageAccountName"] == ACCOUNT and len(res["deletes"]["checkpoints"]) == 2
    assert res["plan"] == [f"pulumi state unprotect --all --yes --stack {STACK}", f"pulumi destroy --yes --stack {STACK}"]
    assert f"pulumi state unprotect --all --yes --stack {STACK}" in r.flat and f"pulumi destroy --yes --stack {STACK}" in r.flat
    assert "2 committed checkpoint(s)" in r.flat

    r = env.run("delete-archive", stdin=f"{ACCOUNT}\n")
    assert r.rc == 0, r.err
    assert env.commands()[-2:] == ["state unprotect", "destroy"]
    assert env.stacks()[STACK]["destroyed"] is True


def test_missing_pulumi_cli_is_one_clear_error(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    r = env.run("--dry-run")
    assert r.rc == 2
    # One message, up front: what the dry run needs the CLI for, and the offline alternative.
    assert "pulumi CLI, which is not on PATH" in r.flat and "make plan STACK=prod" in r.flat and "Traceback" not in r.flat


def test_runs_as_a_program_the_way_make_calls_it(env: Env) -> None:
    """`make teardown` runs `python -m tiered_ops.teardown_cli --stack S ARGS`: no in-process patches here, so
    use a stack whose compute side is already off (no ARM call) and skip the Blob listing."""
    import json
    import subprocess
    import sys


    stacks = env.stacks()
    stacks[STACK]["outputs"] = {**stacks[STACK]["outputs"], "computeEnabled": False, "amlfsName": None,
                                "autoExportJobName": None, "computeResourceGroup": None}
    (env.state / "stacks.json").write_text(json.dumps(stacks))
    p = subprocess.run([sys.executable, "-m", "tiered_ops.teardown_cli", *env.args("--yes", "--no-blob-check", "--json")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["ok"] is True and res["come_back"][0] == COME_BACK
    assert env.commands() == ["stack output", "config get", "config get", "config get", "config set", "up", "stack output"]
    assert env.calls()[4] == ["config", "set", "tiered:computeEnabled", "false", "--stack", STACK]
    assert env.calls()[5] == ["up", "--yes", "--stack", STACK]


# ---------------------------------------------------------------------------------------------
# Content, not size: a stale version or zeros of the same size in Blob never pass the gate


def _stale_version_in_blob(env: Env) -> str:
    """Blob holds an older save of step30 (same sizes, older marker); Lustre the re-save."""
    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30, fill=1)
    env.archive(d)
    old_marker = (d / "COMMITTED.json").read_bytes()
    import shutil
    import time

    shutil.rmtree(d)
    time.sleep(0.01)                                  # another mtime: the HSM sees new files
    d = env.write_ckpt(2, 30, fill=2)                 # the same name saved again, other bytes
    assert len((d / "COMMITTED.json").read_bytes()) == len(old_marker) != 0
    assert (d / "COMMITTED.json").read_bytes() != old_marker
    env.last_success(later())
    return f"llama/{d.name}"


def test_gate_refuses_a_stale_blob_version_of_the_same_size(env: Env) -> None:
    key = _stale_version_in_blob(env)
    for extra in ((), ("--verify-content",)):
        r = env.run("--yes", "--json", "--lustre-root", str(env.mount), *extra)
        assert r.rc == 1, r.err
        problems = r.json()["gate"]["problems"]
        kinds = {(p["kind"], p["file"]) for p in problems if p["checkpoint"] == key}
        assert ("marker-differs", "COMMITTED.json") in kinds, problems
        # Each shard: the HSM says the Lustre file changed since export / the bytes differ.
        assert {k for k, f in kinds if f != "COMMITTED.json"} == ({"file-content"} if extra else {"not-archived"}), problems
        assert "another save of this name" in r.json()["error"]
        assert env.mutating() == [] and env.arm_changes() == [] and env.outputs()["amlfsName"] == "fs1"


def _zeros_in_a_shard(env: Env) -> str:
    archived_ckpts(env, 1)
    d = env.write_ckpt(2, 30)
    env.archive(d)
    env.put_blob(f"checkpoints/llama/{d.name}/rank1.bin", bytes(3000))      # same size, zeros
    env.last_success(later())
    return f"llama/{d.name}"


def test_gate_refuses_same_size_zeros_in_a_shard(env: Env) -> None:
    key = _zeros_in_a_shard(env)
    # Downloaded and hashed (without and with a Lustre scan): the bytes are not the manifest's.
    for extra in ((), ("--lustre-root", str(env.mount), "--verify-content")):
        r = env.run("--yes", "--json", *extra)
        assert r.rc == 1, r.err
        problems = r.json()["gate"]["problems"]
        assert [(p["kind"], p["checkpoint"], p["file"]) for p in problems] == [("file-content", key, "rank1.bin")], problems
        assert "other bytes of the same size" in problems[0]["message"]
        assert env.mutating() == [] and env.arm_changes() == []
    # Nothing proves content (no exporter metadata, no Lustre, no download): refuse, and say how to prove it.
    env.verify_content = False
    r = env.run("--yes", "--json")
    assert r.rc == 1
    problems = r.json()["gate"]["problems"]
    assert {p["kind"] for p in problems} == {"content-unproven"}
    assert "--verify-content" in problems[0]["message"]
    assert env.mutating() == [] and env.arm_changes() == []


def test_gate_says_which_content_proof_it_used_per_checkpoint(env: Env) -> None:
    names = archived_ckpts(env, 2)
    r = env.run("--dry-run", "--json", "--lustre-root", str(env.mount))
    assert r.rc == 0, r.err
    proofs = r.json()["gate"]["proofs"]
    assert set(proofs) == set(names)
    assert all("marker identical to Lustre's" in v and "2 file(s) by lfs hsm_state archived of 2" in v for v in proofs.values())
    r = env.run("--dry-run", "--json")                   # blob only: downloaded
    assert r.rc == 0, r.err
    assert all("2 file(s) by downloaded content hash of 2" in v for v in r.json()["gate"]["proofs"].values())
    assert "gate: PASS" in r.flat and "downloaded content hash" in r.flat


def test_verify_content_hashes_each_blob_once_across_polls(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiered_ops.evidence as td

    archived_ckpts(env, 2)
    calls: list[str] = []
    orig = td.download_hash

    def counting(store, rel, *a, **k):  # noqa: ANN001,ANN002,ANN003,ANN202
        calls.append(rel)
        return orig(store, rel, *a, **k)

    monkeypatch.setattr(td, "download_hash", counting)
    r = env.run("--yes")                                # polls until two iterations, then the final re-check
    assert r.rc == 0, r.err
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 4


def test_an_unwritable_journal_is_one_clear_error(env: Env) -> None:
    archived_ckpts(env, 1)
    env.journal_dir.parent.mkdir(parents=True, exist_ok=True)
    env.journal_dir.write_text("a file where the journal directory should be")
    r = env.run("--yes")
    assert r.rc in (1, 2) and "Traceback" not in r.err
    assert str(env.journal_dir) in r.flat and env.mutating() == []


def test_without_the_pulumi_cli_the_dry_run_says_up_front_what_it_needs(tmp_path: pathlib.Path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-m", "tiered_ops.teardown_cli", "--stack", "prod", "--dry-run",
                        "--state-dir", str(tmp_path / "td")], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr
    first = p.stderr.strip().splitlines()[0]
    assert first.startswith("error: the dry run reads stack 'prod'") and "pulumi CLI, which is not on PATH" in first, p.stderr
    assert "make plan STACK=prod" in " ".join(p.stderr.split())
    h = subprocess.run([sys.executable, "-m", "tiered_ops.teardown_cli", "--help"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert "needs `pulumi` on PATH" in " ".join(h.stdout.split())
