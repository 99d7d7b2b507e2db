"""Scripted teardown between training campaigns: prove the archive, then remove the compute side.

    outputs -> gate (wait / manual export) -> disable auto-export -> computeEnabled=false -> pulumi up

The decision is tiered_ops.gate.evaluate (pure); tiered_ops.evidence gathers what it decides over
(ARM, Blob, optionally a Lustre mount); this module runs the steps, and tiered_ops.teardown_state
keeps a small journal so that a re-run after an interruption continues safely. The archive
(storage account, containers) stays under Pulumi's management; deleting it is the separate
command in tiered_ops.delete_archive. docs/teardown.md explains.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TypedDict

from tiered_ckpt.cli.output import human_bytes, redact
from tiered_ckpt.errors import EXIT_FAILED, UserError
from tiered_ckpt.tiers.arm import AmlfsJobs, ArchiveProgress
from tiered_ckpt.tiers.arm_model import ADMIN_DISABLE, ADMIN_ENABLE, AUTOEXPORT_DISABLED, AUTOEXPORT_RUNNING
from tiered_ops import archive_tiering
from tiered_ops.evidence import Collector, StackOutputs
from tiered_ops.gate import EXPORT_NOT_FOUND, GateResult, ManualArchive, evaluate
from tiered_ops.pulumi_cli import PulumiCli
from tiered_ops.teardown_state import Journal, Options, now_utc

COMPUTE_KEY = "tiered:computeEnabled"

__all__ = ["COMPUTE_KEY", "Refused", "Teardown", "TeardownStep", "ask_stdin"]


class Refused(UserError):
    """The gate (or the operator) said no; nothing was changed. `.result` is the --json report."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, result: dict[str, Any] | None = None, exit_code: int | None = None) -> None:
        super().__init__(message, exit_code=exit_code)
        self.result = result or {}



class TeardownStep(TypedDict):
    """One step a teardown runs, as --dry-run prints it and --json reports it (under "plan")."""

    step: str
    what: str
    command: str       # the command an operator could run instead; "" where there is none


# ---------------------------------------------------------------------------------------------
# The steps runner


class Teardown:
    def __init__(self, opts: Options, *, pulumi: PulumiCli | None = None, sleep: Callable[[float], None] = time.sleep,
                 ask: Callable[[str], str] | None = None) -> None:
        self.o = opts
        self.pulumi = pulumi or PulumiCli(opts.stack, opts.project_dir)
        self.sleep = sleep
        self.ask = ask or ask_stdin
        self.journal = Journal.load(opts.state_dir, opts.stack)
        self.evidence = Collector(opts, self.journal, self.say)
        self.manual: ManualArchive | None = None
        self.lifecycle: dict[str, int] = {}     # coolAfterDays/coldAfterDays, read at the start of run()

    # -- output -----------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        sys.stderr.write(redact(msg) + "\n")
        sys.stderr.flush()

    def confirm(self, question: str) -> bool:
        if self.o.yes:
            return True
        return self.ask(f"{question} [y/N] ").strip().lower() in ("y", "yes")

    # -- evidence (tiered_ops.evidence) ---------------------------------------------------------
    @property
    def outputs(self) -> StackOutputs:
        return self.evidence.outputs

    @outputs.setter
    def outputs(self, value: StackOutputs) -> None:
        self.evidence.outputs = value

    def jobs(self) -> AmlfsJobs:
        return self.evidence.jobs()

    # -- the gate with waiting and the optional manual export ---------------------------------
    def gate(self) -> GateResult:
        deadline = time.monotonic() + self.o.wait_timeout
        manual: ManualArchive | None = None
        last: tuple[float, int] | None = None
        while True:
            result = evaluate(self.evidence.collect(manual))
            if result.ok or self.o.dry_run or self.o.force:
                return result
            if self.o.manual_export and manual is None and self.outputs.compute_present:
                manual = self.manual = self.manual_export(deadline)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return result
            have = result.total_bytes - result.missing_bytes
            rate = eta = ""
            if last is not None and result.total_bytes:
                dt = time.monotonic() - last[0]
                r = (have - last[1]) / dt if dt > 0 else 0.0
                if r > 0:
                    rate = f", {human_bytes(r)}/s"
                    eta = f", ETA {result.missing_bytes / r:.0f} s"
            last = (time.monotonic(), have)
            size = f"{human_bytes(have)} of {human_bytes(result.total_bytes)} in Blob{rate}{eta}; " if result.total_bytes else ""
            self.say(f"waiting for the archive: {size}{len(result.problems)} problem(s), first: {result.problems[0].message}; "
                     f"{left / 60:.1f} min left (--wait-timeout)")
            self.sleep(min(self.o.poll_interval, max(left, 0.0)))

    def manual_export(self, deadline: float) -> ManualArchive:
        """Disable auto-export, archive the checkpoint prefix, wait. One blob job at a time."""
        jobs, prefix = self.jobs(), self.outputs.prefix
        while True:
            busy = jobs.running_blob_jobs()
            if not busy:
                break
            if time.monotonic() >= deadline:
                raise Refused(f"cannot start the manual export: another blob job is still running ({', '.join(busy)}) "
                              "after --wait-timeout; nothing was changed. Re-run when it has finished")
            self.say(f"manual export: waiting for {', '.join(busy)} to finish (one blob job at a time)")
            self.sleep(self.o.poll_interval)
        self.say("manual export: disabling auto-export (one blob job at a time) ...")
        self.journal.mark("autoexport_disabled", by="manual-export")
        jobs.disable_autoexport(timeout=max(deadline - time.monotonic(), 1.0))
        started = now_utc()
        self.say(f"manual export: archiving {prefix} ...")
        jobs.start_archive(prefix)
        self.journal.mark("manual_archive_started", path=prefix, started=started.isoformat())

        def progress(p: ArchiveProgress) -> None:
            self.say(f"manual export of {prefix}: {p.state} {p.percent if p.percent is not None else '?'}%")

        try:
            prog = jobs.wait_archive(prefix, timeout=max(deadline - time.monotonic(), 1.0), on_progress=progress)
            state = prog.state
        except UserError as e:
            self.say(f"manual export: {e}")
            state = jobs.archive_status(prefix).state
        return ManualArchive(started, state)

    def reenable_autoexport(self) -> str:
        """Undo our disable (refusal or decline). Returns a sentence for the report."""
        if not self.journal.done("autoexport_disabled") or not self.outputs.compute_present:
            return ""
        try:
            st = self.jobs().autoexport_status()
            if st.admin_status == ADMIN_ENABLE and st.state == AUTOEXPORT_RUNNING:
                # Our disable was refused outright (e.g. 403): there is nothing to undo.
                self.journal.unmark("autoexport_disabled")
                return ""
            self.jobs().enable_autoexport()
        except UserError as e:
            return f"auto-export is still DISABLED (re-enabling failed: {e}); run: {self.jobs().target.enable_command()}"
        self.journal.unmark("autoexport_disabled")
        return "auto-export was re-enabled"

    # -- the steps ------------------------------------------------------------------------------
    def steps(self) -> list[TeardownStep]:
        """What this teardown will run, in order (printed by --dry-run; "plan" in the --json report)."""
        p, o = self.pulumi, self.outputs
        steps: list[TeardownStep] = [{"step": "outputs", "what": "read the stack outputs", "command": p.text("stack", "output", "--json")}]
        if o.compute_present:
            t = o.target(self.o.arm_endpoint)
            steps.append({"step": "gate", "what": (
                f"prove the archive holds every committed checkpoint: auto-export {t.autoexport_job} on {t.filesystem} "
                f"(InProgress, last iteration after the newest commit, zero failed files)"
                + (f", Blob container {o.get('dataContainer')} under {o.prefix} (markers, file sizes and content: "
                   + ("every file downloaded and hashed" if self.o.verify_content else
                      "exporter hash metadata or lfs hsm_state") + ")" if self.o.blob_check else "")
                + (f", Lustre markers under {self.o.lustre_root}{o.prefix}" if self.o.lustre_root else "")
                + f"; wait up to {self.o.wait_timeout / 60:.0f} min"
                + ("; if needed, disable auto-export and run a manual archive of " + o.prefix if self.o.manual_export else "")),
                "command": ""})
            steps.append({"step": "disable-autoexport", "what": f"disable auto-export {t.autoexport_job} and wait for Disabled",
                          "command": t.admin_command(ADMIN_DISABLE)})
        steps.append({"step": "config", "what": "turn the compute side off (the archive stays managed)",
                      "command": p.text("config", "set", COMPUTE_KEY, "false")})
        if not self.o.yes:
            steps.append({"step": "preview", "what": "show what `pulumi up` will delete, then ask",
                          "command": p.text("preview", "--diff")})
        steps.append({"step": "up", "what": "delete the GPU cluster, the file system (and its auto-export job) and the network",
                      "command": p.text("up", "--yes")})
        return steps

    def come_back(self) -> list[str]:
        s = self.o.stack
        return [f"pulumi config set {COMPUTE_KEY} true --stack {s} && pulumi up --stack {s}",
                "tiered-ckpt restore --latest   # on a node of the new cluster"]

    # -- run ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.say(f"reading the outputs of stack {self.o.stack} ...")
        before = StackOutputs(self.pulumi.outputs())
        self.outputs = before
        before.require("storageAccountName", "dataContainer")
        # Read before anything changes: the report says when each kept checkpoint tiers under them.
        self.lifecycle = archive_tiering.lifecycle_days(self.pulumi.config_get)
        resumed = sorted(self.journal.data["steps"])
        if resumed:
            self.say(f"continuing an interrupted teardown (done: {', '.join(resumed)}; journal {self.journal.path})")
        steps = self.steps()
        result: dict[str, Any] = {"ok": False, "stack": self.o.stack, "dry_run": self.o.dry_run, "plan": steps,
                                  "resumed_steps": resumed}
        if not before.compute_present:
            self.say(f"stack {self.o.stack} has no file system (computeEnabled false): the compute side is already gone")

        try:
            gate = self.gate()
        except UserError as e:
            undo = "" if self.o.dry_run else self.reenable_autoexport()
            raise UserError(f"{e}{'; ' + undo if undo else ''}", exit_code=e.exit_code) from None
        result["gate"] = gate.to_json()
        # A refusal lists the problems in its error message; print them here only when not refusing.
        self._print_gate(gate, problems=gate.ok or self.o.dry_run or self.o.force)
        if not gate.ok and not self.o.force:
            undo = "" if self.o.dry_run else self.reenable_autoexport()
            result.update(refused=True, undo=undo)
            if self.o.dry_run:
                self.say("dry run: the teardown would refuse here; nothing was changed")
                return result
            raise Refused(self._refusal(gate, undo), result=result)
        if self.o.dry_run:
            self.say("dry run: these steps would run; nothing was changed:")
            for s in steps:
                self.say(f"  {s['step']}: {s['what']}" + (f"\n      {s['command']}" if s["command"] else ""))
            result["archive_tiering"], lines = self.tiering(gate)
            for line in lines:
                self.say(line)
            result["ok"] = True
            return result
        if self.o.force and not gate.ok:
            typed = self.ask(f"--force: the gate found {len(gate.problems)} problem(s) above; checkpoints not in Blob will be "
                             f"LOST. Type the stack name ({self.o.stack}) to continue: ").strip()
            if typed != self.o.stack:
                raise Refused(f"--force: you typed {typed!r}, not the stack name {self.o.stack!r}; nothing was changed",
                              result=result)
            result["forced"] = True
        if not self.confirm(f"remove the compute side of stack {self.o.stack} (the archive stays)?"):
            raise Refused("not confirmed; nothing was changed", result=result)

        if before.compute_present:
            self.disable_autoexport()
            if not self.o.force:
                # Auto-export is off now, so the proof cannot go stale; check once more that
                # nothing was committed between the gate and the disable.
                final = evaluate(self.evidence.collect(self.manual))
                if not final.ok:
                    self._print_gate(final, problems=False)
                    undo = self.reenable_autoexport()
                    result.update(refused=True, gate=final.to_json(), undo=undo)
                    raise Refused(self._refusal(final, undo), result=result)

        if not self.journal.done("config_previous"):
            self.journal.mark("config_previous", value=self.pulumi.config_get(COMPUTE_KEY))
        self.say(f"$ {self.pulumi.text('config', 'set', COMPUTE_KEY, 'false')}")
        self.pulumi.config_set(COMPUTE_KEY, "false")
        self.journal.mark("config_set")
        if not self.o.yes:
            self.say(f"$ {self.pulumi.text('preview', '--diff')}")
            self.pulumi.stream("preview", "--diff")
            if not self.confirm("apply this update (delete what the preview lists)?"):
                undo = self.undo_config()
                undo2 = self.reenable_autoexport()
                raise Refused(f"not confirmed; nothing was removed ({'; '.join(x for x in (undo, undo2) if x)})", result=result)
        self.say(f"$ {self.pulumi.text('up', '--yes')}")
        try:
            self.pulumi.stream("up", "--yes")
        except UserError as e:
            back = f"pulumi config set {COMPUTE_KEY} true --stack {self.o.stack} && pulumi up --stack {self.o.stack}"
            if before.compute_present:
                # `pulumi up` does not see the out-of-band PATCH (no refresh), so say how to undo it.
                back += f", then re-enable auto-export: {self.jobs().target.enable_command()}"
            raise UserError(
                f"{e}. The teardown stopped after disabling auto-export and setting {COMPUTE_KEY}=false. Re-run the same "
                f"command to continue (journal {self.journal.path}); to go back to training instead: {back}",
                exit_code=e.exit_code) from None
        self.journal.mark("up_done")
        after = StackOutputs(self.pulumi.outputs())
        report = self.report(before, after, gate)
        result.update(ok=True, **report)
        self.journal.data["completed"] = now_utc().isoformat()
        self.journal.save()
        return result

    def disable_autoexport(self) -> None:
        jobs = self.jobs()
        st = self.evidence.export_state()
        if st.state == EXPORT_NOT_FOUND:
            # Gone already (an earlier run's `pulumi up`), or --force over a missing job: nothing to stop.
            self.say(f"auto-export job {jobs.target.autoexport_job} on {jobs.target.filesystem} not found; nothing to disable")
            return
        if st.state == AUTOEXPORT_DISABLED:
            self.say(f"auto-export {jobs.target.autoexport_job} is already Disabled")
            self.journal.mark("autoexport_disabled", by=self.journal.data["steps"].get("autoexport_disabled", {}).get("by", "teardown"))
            return
        self.say(f"disabling auto-export {jobs.target.autoexport_job} and waiting for Disabled ...")
        try:
            self.journal.mark("autoexport_disabled", by="teardown")
            jobs.disable_autoexport(timeout=self.o.disable_timeout)
        except UserError as e:
            undo = self.reenable_autoexport()
            raise UserError(f"{e}. Nothing was removed (no pulumi config set/up ran){'; ' + undo if undo else ''}",
                          exit_code=e.exit_code) from None

    def undo_config(self) -> str:
        prev = (self.journal.data["steps"].get("config_previous") or {}).get("value")
        if prev is None:
            self.pulumi.config_rm(COMPUTE_KEY)
        else:
            self.pulumi.config_set(COMPUTE_KEY, str(prev))
        self.journal.unmark("config_set")
        return f"{COMPUTE_KEY} restored to {prev if prev is not None else 'its default (unset)'}"

    # -- messages -------------------------------------------------------------------------------
    def _print_gate(self, gate: GateResult, problems: bool = True) -> None:
        self.say(f"gate: {'PASS' if gate.ok else 'FAIL'}")
        for e in gate.evidence:
            self.say(f"  evidence: {e}")
        for w in gate.warnings:
            self.say(f"  warning: {w}")
        if problems:
            for p in gate.problems:
                self.say(f"  missing: {p.message}")

    def _refusal(self, gate: GateResult, undo: str) -> str:
        lines = [f"refusing to tear down stack {self.o.stack}: the archive does not provably hold every committed checkpoint; "
                 f"nothing was removed{' (' + undo + ')' if undo else ''}. What is missing:"]
        lines += [f"  - {p.message}" for p in gate.problems]
        lines.append("Wait longer (--wait-timeout 2h), run a manual export (--manual-export), or, knowing what is lost, "
                     "--force (you will be asked to type the stack name)")
        return "\n".join(lines)

    def tiering(self, gate: GateResult) -> tuple[list[dict[str, Any]], list[str]]:
        """When each kept checkpoint's blobs tier under this stack's lifecycle policy (and that none expires):
        the --json entries and the lines to print."""
        cool, cold = self.lifecycle["coolAfterDays"], self.lifecycle["coldAfterDays"]
        plan = archive_tiering.schedule(gate.committed_utc, cool, cold)
        lines = [f"Kept checkpoints under the Blob lifecycle policy (coolAfterDays {cool}, coldAfterDays {cold}; "
                 "counted from each blob's export):"] if plan else []
        lines += [f"  {t.sentence(cool, cold)}" for t in plan]
        return [t.to_json() for t in plan], lines

    def report(self, before: StackOutputs, after: StackOutputs, gate: GateResult) -> dict[str, Any]:
        removed = {k: before.get(k) for k in ("amlfsName", "autoExportJobName", "computeResourceGroup", "nodeCount", "scaleSetName")
                   if before.get(k) is not None}
        archive = {"storageAccountName": after.get("storageAccountName") or before.get("storageAccountName"),
                   "storageAccountUrl": after.get("storageAccountUrl") or before.get("storageAccountUrl"),
                   "dataContainer": after.get("dataContainer") or before.get("dataContainer"),
                   "checkpointPrefix": before.prefix, "newestCheckpoint": gate.newest,
                   "checkpoints": len(gate.checkpoints)}
        tiering, lines = self.tiering(gate)
        out = {"removed": removed, "archive": archive, "come_back": self.come_back(), "archive_tiering": tiering}
        if not self.o.as_json:
            print(f"Teardown of stack {self.o.stack} done.")
            if removed:
                print(f"Removed: file system {removed.get('amlfsName')} with auto-export job {removed.get('autoExportJobName')}, "
                      f"the GPU cluster ({removed.get('nodeCount', '?')} nodes), the network, and resource group "
                      f"{removed.get('computeResourceGroup')}.")
            else:
                print("Removed: nothing this time (the compute side was already gone); the stack is converged.")
            print(f"Checkpoints are in storage account {archive['storageAccountName']}, container {archive['dataContainer']}, "
                  f"prefix {archive['checkpointPrefix']}/ ({archive['checkpoints']} committed; newest {gate.newest or 'none'}).")
            for line in lines:
                print(line)
            print("To come back:")
            for c in self.come_back():
                print(f"  {c}")
        return out


def ask_stdin(prompt: str) -> str:
    sys.stderr.write(prompt)
    sys.stderr.flush()
    line = sys.stdin.readline()
    return line.rstrip("\n")
