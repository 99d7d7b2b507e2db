"""A stand-in for the `pulumi` CLI (it cannot run here: no backend, no Azure).

The executable wrapper tests/doubles/pulumi_bin/pulumi runs this file; tests put that folder first
on PATH. State lives in $FAKE_PULUMI_STATE (a folder):

* stacks.json  {stack: {"config": {key: value}, "outputs_on": {...}, "outputs": {...}, "protected": bool}}
  `outputs_on` is what the program exports with the compute side on; `pulumi up` derives the
  outputs from the stack config like the real program does (tiered:computeEnabled false -> the
  compute-side outputs are null).
* calls.jsonl  one JSON line per invocation: {"argv": [...], "cwd": "..."}
* faults.json  {"up": [{"exit": 1, "stderr": "...", "apply": false}], ...}: the next invocation of
  that command (first words, e.g. "up", "config set", "stack output") fails like this, once each.
  "apply": true applies the change before failing (a kill after the resources went).

Behaviour follows the CLI's documentation: `stack output --json` prints the outputs as a JSON
object; `config get` of an unset key fails with "configuration key ... not found"; `up` without
--yes in a non-interactive session fails; `destroy` refuses while resources are protected.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

COMPUTE_OUTPUTS = ("computeResourceGroup", "amlfsName", "autoExportJobName", "mgsAddress", "mountCommand",
                   "provisionedGBps", "nodeCount", "scaleSetName", "nodeIdentityClientId")
VALUE_FLAGS = {"--stack", "-s", "--cwd", "-C", "--color", "--message", "-m", "--config-file"}


def _state_dir() -> Path:
    d = os.environ.get("FAKE_PULUMI_STATE")
    if not d:
        sys.stderr.write("fake pulumi: FAKE_PULUMI_STATE is not set\n")
        sys.exit(2)
    return Path(d)


def _load(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def _save(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def parse(argv: list[str]) -> tuple[list[str], dict[str, str | bool]]:
    words: list[str] = []
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-"):
            if "=" in a:
                k, v = a.split("=", 1)
                flags[k] = v
            elif a in VALUE_FLAGS and i + 1 < len(argv):
                flags[a] = argv[i + 1]
                i += 1
            else:
                flags[a] = True
        else:
            words.append(a)
        i += 1
    return words, flags


def derive_outputs(stack: dict[str, Any]) -> dict[str, Any]:
    on = dict(stack.get("outputs_on") or {})
    enabled = str(stack.get("config", {}).get("tiered:computeEnabled", "true")).lower() != "false"
    if enabled:
        on["computeEnabled"] = True
        return on
    off = {k: (None if k in COMPUTE_OUTPUTS else v) for k, v in on.items()}
    off["computeEnabled"] = False
    return off


def main(argv: list[str]) -> int:
    state = _state_dir()
    with open(state / "calls.jsonl", "a") as log:
        log.write(json.dumps({"argv": argv, "cwd": os.getcwd()}) + "\n")
    words, flags = parse(argv)
    name = str(flags.get("--stack") or flags.get("-s") or "")
    stacks = _load(state / "stacks.json", {})
    faults = _load(state / "faults.json", {})
    yes = bool(flags.get("--yes") or flags.get("-y"))

    cmd = " ".join(words[:2]) if words[:1] in (["stack"], ["config"], ["state"]) else " ".join(words[:1])
    fault = None
    if faults.get(cmd):
        fault = faults[cmd].pop(0)
        _save(state / "faults.json", faults)
    if fault and not fault.get("apply"):
        sys.stderr.write(fault.get("stderr", f"error: {cmd} failed (injected)") + "\n")
        return int(fault.get("exit", 1))

    if name not in stacks:
        sys.stderr.write(f"error: no stack named '{name}' found\n")
        return 255
    st = stacks[name]
    rc = 0
    if cmd == "stack output":
        out = st.get("outputs", {})
        if flags.get("--json"):
            sys.stdout.write(json.dumps(out, indent=4) + "\n")
        else:
            for k, v in out.items():
                sys.stdout.write(f"    {k}  {v}\n")
    elif cmd == "config get":
        key = words[2]
        if key not in st.get("config", {}):
            sys.stderr.write(f"error: configuration key '{key}' not found for stack '{name}'\n")
            return 255
        sys.stdout.write(str(st["config"][key]) + "\n")
    elif cmd == "config set":
        st.setdefault("config", {})[words[2]] = words[3]
    elif cmd == "config rm":
        st.setdefault("config", {}).pop(words[2], None)
    elif cmd == "preview":
        new = derive_outputs(st)
        gone = [k for k in COMPUTE_OUTPUTS if st.get("outputs", {}).get(k) is not None and new.get(k) is None]
        sys.stdout.write(f"Previewing update ({name}):\n")
        for k in gone:
            sys.stdout.write(f" -   output {k} (delete)\n")
        sys.stdout.write(f"Resources:\n    - {len(gone)} to delete\n")
    elif cmd == "up":
        if not yes and not flags.get("--skip-preview"):
            sys.stderr.write("error: --yes or --skip-preview must be passed in to proceed when running in non-interactive mode\n")
            return 255
        st["outputs"] = derive_outputs(st)
        sys.stdout.write(f"Updating ({name}):\nUpdate complete.\n")
    elif cmd == "state unprotect":
        if not yes:
            sys.stderr.write("error: confirmation declined, not proceeding with the unprotect\n")
            return 255
        st["protected"] = False
    elif cmd == "destroy":
        if not yes:
            sys.stderr.write("error: --yes must be passed in to proceed when running in non-interactive mode\n")
            return 255
        if st.get("protected", True):
            sys.stderr.write("error: Preview failed: resource is protected. To unprotect the resource, either remove the "
                             "`protect` flag from the resource in your Pulumi program and run `pulumi up`, or use the "
                             "command: `pulumi state unprotect`\n")
            return 255
        st["outputs"] = {}
        st["destroyed"] = True
    else:
        sys.stderr.write(f"fake pulumi: unsupported command {argv}\n")
        return 2
    _save(state / "stacks.json", stacks)
    if fault:
        sys.stderr.write(fault.get("stderr", f"error: {cmd} failed (injected)") + "\n")
        return int(fault.get("exit", 1))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
