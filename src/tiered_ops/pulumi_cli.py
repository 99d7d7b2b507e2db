"""The Pulumi CLI as the operator would type it: every call is a real `pulumi ...` command line.

The operator scripts drive the CLI (not the Automation API) so that the commands the teardown
lists as its steps (--dry-run, --json) are exactly what an operator could paste, and so the stack's own backend, login
and secrets provider apply unchanged.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import EXIT_FAILED, ConfigError, UserError


class PulumiError(UserError):
    """A pulumi command exited non-zero."""

    exit_code = EXIT_FAILED


class PulumiCli:
    def __init__(self, stack: str, cwd: Path, binary: str = "pulumi") -> None:
        self.stack = stack
        self.cwd = cwd
        self.binary = binary

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *args, "--stack", self.stack]

    def text(self, *args: str) -> str:
        """The command line as an operator types it."""
        return shlex.join(["pulumi", *args, "--stack", self.stack])

    def _exe(self) -> str:
        found = shutil.which(self.binary)
        if found is None:
            raise ConfigError(
                f"the pulumi CLI ({self.binary}) is not on PATH; install it (https://www.pulumi.com/docs/install/), "
                f"log in to the stack's backend (pulumi login), and run from the project directory {self.cwd}"
            )
        return found

    def _fail(self, args: Sequence[str], rc: int, detail: str) -> PulumiError:
        last = [ln for ln in detail.strip().splitlines() if ln.strip()][-3:]
        why = " | ".join(last) if last else f"exit status {rc}"
        return PulumiError(f"`{self.text(*args)}` failed (exit {rc}): {why}")

    def capture(self, *args: str, ok_codes: Sequence[int] = (0,)) -> tuple[int, str]:
        """Run and return (exit status, stdout); stderr goes into the error message on failure."""
        proc = subprocess.run([self._exe(), *self.argv(*args)[1:]], cwd=self.cwd, capture_output=True, text=True)
        if proc.returncode not in ok_codes:
            raise self._fail(args, proc.returncode, proc.stderr or proc.stdout)
        return proc.returncode, proc.stdout

    def stream(self, *args: str) -> None:
        """Run with the output relayed to our stderr line by line (stdout stays clean for --json)."""
        proc = subprocess.Popen([self._exe(), *self.argv(*args)[1:]], cwd=self.cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stderr.write(line)
                tail = (tail + [line])[-20:]
            rc = proc.wait()
        except BaseException:
            # Ctrl-C: pulumi handles SIGINT itself (it finishes the current step); wait for it.
            proc.wait()
            raise
        sys.stderr.flush()
        if rc != 0:
            raise self._fail(args, rc, "".join(tail))

    # -- the commands the scripts use --------------------------------------------------------

    def outputs(self) -> dict[str, Any]:
        _, out = self.capture("stack", "output", "--json")
        try:
            data = json.loads(out or "{}")
        except ValueError:
            raise PulumiError(f"`{self.text('stack', 'output', '--json')}` printed something that is not JSON: {out[:200]!r}") from None
        if not isinstance(data, dict):
            raise PulumiError(f"`{self.text('stack', 'output', '--json')}` did not print a JSON object")
        return data

    def config_get(self, key: str) -> str | None:
        """The stack's value, or None when the key is not set (pulumi exits non-zero with 'not found')."""
        proc = subprocess.run([self._exe(), *self.argv("config", "get", key)[1:]], cwd=self.cwd, capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout.strip()
        if "not found" in (proc.stderr + proc.stdout):
            return None
        raise self._fail(("config", "get", key), proc.returncode, proc.stderr or proc.stdout)

    def config_set(self, key: str, value: str) -> None:
        self.capture("config", "set", key, value)

    def config_rm(self, key: str) -> None:
        self.capture("config", "rm", key)
