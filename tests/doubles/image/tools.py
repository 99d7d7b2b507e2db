"""Stand-ins for the system tools of Microsoft's Ubuntu-HPC 24.04 image, run as `tools.py NAME ARGS...`.

Each behaves as the named source documents the real image/tool, against a fake root (IMAGE_ROOT) and a state
file (IMAGE_ROOT/.image/state.json). What they encode:

* apt-get / apt-cache: the repositories the image configures and its pin file. Azure/azhpc-images
  components/slurm-repo/slurm-u.pin (installed by install_pmix.sh as
  /etc/apt/preferences.d/slurm-repository-pin-990) gives Ubuntu's `slurm*` priority -1, so `apt-get install
  slurmd` finds no candidate; Microsoft's repos/slurm-ubuntu-noble has slurm-smd* (Azure/cyclecloud-slurm
  azure-slurm-install/ubuntu.sh installs them as name=version). apt_preferences(5): "P < 0 prevents the
  version from being installed". The AMLFS repo (azhpc-images ubuntu/common/setup_lustre_repo.sh) has the
  DKMS client and the prebuilt kmod metapackages amlfs-lustre-client-<ver> whose version is the kernel
  (azure-stack-docs azure-managed-lustre/client-install-plan.md; packages.microsoft.com amlfs-noble index).
* Package effects: slurm-smd-slurmd / slurm-smd-slurmctld install SchedMD's units (units/*.service.in,
  Type=notify) and /etc/default/slurmd, and create no users (SchedMD debian/: no maintainer scripts;
  Microsoft's installer creates slurm/munge itself, azure-slurm-install/install.py setup_users). Ubuntu's
  munge creates a `munge` system user with the next free system uid when none exists (Debian's
  munge.postinst: `adduser --quiet --system --group --no-create-home --home /nonexistent munge`).
  DKMS and kmod Lustre clients never both (client-install-plan.md).
* modprobe / mokutil / modinfo / dkms: a DKMS-built module is unsigned, and with `mokutil --sb-state` saying
  "SecureBoot enabled" the kernel refuses it ("Key was rejected by service"); the kmod package's module is
  signed with the Azure Services Linux Kmod PCA certificate, which Trusted Launch firmware trusts
  (azure-managed-lustre client-install-plan.md, client-secure-boot.md).
* systemctl: a unit with Type=notify becomes active only when its daemon sends READY=1; slurmd and
  slurmctld do so only when started with --systemd (SchedMD etc/slurmd.service.in: ExecStart=slurmd
  --systemd $SLURMD_OPTIONS; without it the start times out). EnvironmentFile= and $VAR expansion as
  systemd.service(5), "Command lines" (systemd.py). User= must exist (status=217/USER).
* useradd/groupadd/getent/usermod/chown: against the fake root's passwd/group; ids must be free; chown
  refuses an unknown user ("invalid user").
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import systemd  # noqa: E402  (this directory; the stand-ins run as a script)

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ["IMAGE_ROOT"])
STATE = ROOT / ".image" / "state.json"
UBUNTU, MICROSOFT = "archive.ubuntu.com", "packages.microsoft.com"
SIGNER = "Azure Services Linux Kmod PCA"


def load() -> dict[str, Any]:
    return dict(json.loads(STATE.read_text()))


def save(st: dict[str, Any]) -> None:
    STATE.write_text(json.dumps(st, indent=1, sort_keys=True))


def log(st: dict[str, Any], line: str) -> None:
    st.setdefault("log", []).append(line)


def fail(msg: str, code: int = 1) -> None:
    print(msg, file=sys.stderr)
    raise SystemExit(code)


# --- apt -------------------------------------------------------------------------------------------------

def catalog(st: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(package, version, origin) of every repository the fake root's sources.list.d enables."""
    lists = " ".join(p.read_text() for p in (ROOT / "etc/apt/sources.list.d").glob("*") if p.is_file())
    out: list[tuple[str, str, str]] = [(p, v, UBUNTU) for p, v in st["repo"]["ubuntu"]]
    if "repos/slurm-ubuntu-" in lists:
        out += [(p, v, MICROSOFT) for p, v in st["repo"]["slurm"]]
    if "repos/amlfs-" in lists:
        out += [(p, v, MICROSOFT) for p, v in st["repo"]["amlfs"]]
    return out


def pins() -> list[tuple[list[str], str, int]]:
    """apt_preferences(5) stanzas: (package globs, origin glob, priority)."""
    out = []
    for f in sorted((ROOT / "etc/apt/preferences.d").glob("*")):
        for stanza in re.split(r"\n\s*\n", f.read_text()):
            fields = dict(ln.split(":", 1) for ln in stanza.strip().splitlines() if ":" in ln)
            if {"Package", "Pin", "Pin-Priority"} <= fields.keys():
                pin = fields["Pin"].strip()
                origin = pin.split(None, 1)[1].strip().strip('"') if pin.startswith("origin") else "*"
                out.append(([g for g in re.split(r"[\s,]+", fields["Package"].strip()) if g], origin,
                            int(fields["Pin-Priority"])))
    return out


def priority(pkg: str, origin: str) -> int:
    best: int | None = None
    for globs, oglob, prio in pins():
        if any(fnmatch.fnmatch(pkg, g) for g in globs) and fnmatch.fnmatch(origin, oglob):
            best = prio if best is None else max(best, prio)
    return 500 if best is None else best


def vkey(v: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", v)]


def candidates(st: dict[str, Any], pkg: str) -> list[tuple[str, str, int]]:
    return [(v, o, priority(pkg, o)) for p, v, o in catalog(st) if p == pkg]


def install_effects(st: dict[str, Any], pkg: str, version: str) -> None:
    if pkg == "munge" and not systemd.user_entry(ROOT, "munge"):
        uid = max([u for u in systemd.ids(ROOT, "passwd") if u < 1000] + [100]) + 1   # adduser --system
        systemd.add_line(ROOT / "etc/group", f"munge:x:{uid}:")
        systemd.add_line(ROOT / "etc/passwd", f"munge:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin")
    if pkg == "munge":
        write(ROOT / "lib/systemd/system/munge.service", "[Service]\nType=forking\nExecStart=/usr/sbin/munged\n")
    for daemon in ("slurmd", "slurmctld"):
        if pkg == f"slurm-smd-{daemon}":
            text = (HERE / "units" / f"{daemon}.service.in").read_text()
            text = text.replace("@sbindir@", "/usr/sbin").replace("@sysconfdir@", "/etc/slurm")
            write(ROOT / f"lib/systemd/system/{daemon}.service", text.replace("@SYSTEMD_TASKSMAX_OPTION@", "TasksMax=infinity"))
            write(ROOT / f"etc/default/{daemon}", f'#{daemon.upper()}_OPTIONS=""\n')   # SchedMD debian/*.default
    if pkg.startswith("amlfs-lustre-client-dkms-"):
        st["modules"]["lustre"] = "dkms"
    elif re.match(r"amlfs-lustre-client-\d", pkg):
        dkms = [p for p in st["packages"] if "dkms" in p]
        if dkms:
            fail(f"E: {pkg} conflicts with the installed DKMS client {' '.join(dkms)} "
                 "(client-install-plan.md: the prebuilt kmod or DKMS, never both)", 100)
        if version != st["kernel"]:
            fail(f"E: {pkg}={version} is built for kernel {version}, not the running {st['kernel']}", 100)
        st["modules"]["lustre"] = "kmod"


def apt_get(args: list[str]) -> None:
    st = load()
    log(st, "apt-get " + " ".join(args))
    words = [a for a in args if not a.startswith("-")]
    if not words:
        fail("E: no operation")
    op, names = words[0], words[1:]
    if op == "update":
        save(st)
        return
    if op == "remove":
        for n in names:
            st["packages"].pop(n, None)
            if "dkms" in n:
                st["modules"].pop("lustre", None)
        save(st)
        return
    if op != "install":
        fail(f"E: unsupported apt-get operation {op}")
    chosen = []
    for spec in names:
        pkg, _, want = spec.partition("=")
        cands = candidates(st, pkg)
        if not cands:
            fail(f"E: Unable to locate package {pkg}", 100)
        allowed = [c for c in cands if c[2] >= 0]
        if want:
            match = [c for c in allowed if c[0] == want]
            if not match:
                fail(f"E: Version '{want}' for '{pkg}' was not found", 100)
            chosen.append((pkg, want))
        else:
            if not allowed:
                fail(f"Package {pkg} is not available, but is referred to by another package.\n"
                     f"E: Package '{pkg}' has no installation candidate", 100)
            v = sorted(allowed, key=lambda c: (c[2], vkey(c[0])))[-1][0]
            chosen.append((pkg, v))
    for pkg, v in chosen:
        install_effects(st, pkg, v)
        st["packages"][pkg] = v
    save(st)


def apt_cache(args: list[str]) -> None:
    st = load()
    if args[:2] == ["search", "--names-only"]:
        rx = re.compile(args[2])
        for name in sorted({p for p, _, _ in catalog(st) if rx.search(p)}):
            print(f"{name} - package")
    elif args[:1] == ["madison"]:
        for v, o, _ in candidates(st, args[1]):
            print(f" {args[1]} | {v} | https://{o} noble/main amd64 Packages")
    elif args[:1] == ["policy"]:
        for v, o, prio in candidates(st, args[1]):
            print(f"     {v} {prio}\n        {prio} https://{o}")
    else:
        fail(f"apt-cache: unsupported {args}")


def apt_mark(args: list[str]) -> None:
    st = load()
    if args[:1] == ["hold"]:
        st.setdefault("held", [])
        st["held"] = sorted(set(st["held"]) | set(args[1:]))
    save(st)


def dpkg_query(args: list[str]) -> None:
    st = load()
    fmt = next((a[3:] for a in args if a.startswith("-f=")), "")
    if "-f" in args:
        fmt = args[args.index("-f") + 1]
    fmt = fmt or "${Package}\t${Version}\n"
    globs = [a for a in args if not a.startswith("-") and a != fmt] or ["*"]
    hits = [(p, v) for p, v in sorted(st["packages"].items()) if any(fnmatch.fnmatch(p, g) for g in globs)]
    if not hits:
        fail(f"dpkg-query: no packages found matching {' '.join(globs)}")
    for p, v in hits:
        sys.stdout.write(fmt.replace("${Package}", p).replace("${Version}", v).replace("${db:Status-Abbrev}", "ii ")
                         .replace("\\n", "\n"))


def dpkg(args: list[str]) -> None:
    if args == ["--print-architecture"]:
        print("amd64")
    else:
        fail(f"dpkg: unsupported {args}")


# --- kernel modules --------------------------------------------------------------------------------------

def modprobe(args: list[str]) -> None:
    st = load()
    mod = [a for a in args if not a.startswith("-")][0]
    kind = st["modules"].get(mod)
    log(st, f"modprobe {mod}")
    if kind is None:
        save(st)
        fail(f"modprobe: FATAL: Module {mod} not found in directory /lib/modules/{st['kernel']}")
    if kind == "dkms" and st["secure_boot"]:
        save(st)
        fail(f"modprobe: ERROR: could not insert '{mod}': Key was rejected by service")
    st["loaded"] = sorted(set(st.get("loaded", [])) | {mod})
    save(st)


def modinfo(args: list[str]) -> None:
    st = load()
    mod = args[-1]
    kind = st["modules"].get(mod)
    if kind is None:
        fail(f"modinfo: ERROR: Module {mod} not found.")
    if "-F" in args and args[args.index("-F") + 1] == "signer":
        print(SIGNER if kind == "kmod" else "")
    else:
        print(f"filename: /lib/modules/{st['kernel']}/updates/{mod}.ko")


def mokutil(args: list[str]) -> None:
    if args != ["--sb-state"]:
        fail(f"mokutil: unsupported {args}")
    print("SecureBoot enabled" if load()["secure_boot"] else "SecureBoot disabled")


def dkms(args: list[str]) -> None:
    st = load()
    if args[:1] == ["autoinstall"] and any(p.startswith("amlfs-lustre-client-dkms-") for p in st["packages"]):
        st["modules"]["lustre"] = "dkms"           # built on the node: unsigned
    save(st)


def uname(args: list[str]) -> None:
    print(load()["kernel"] if args == ["-r"] else "Linux")


# --- systemd ---------------------------------------------------------------------------------------------

def strip_root(path: str) -> str:
    r = str(ROOT)
    return path[len(r):] or "/" if path.startswith(r) else path


def systemctl(args: list[str]) -> None:
    st = load()
    log(st, "systemctl " + " ".join(args))
    words = [a for a in args if not a.startswith("-")]
    now = "--now" in args
    op, units = words[0], [u if "." in u else u + ".service" for u in words[1:]]
    if op == "daemon-reload":
        st["automounts"] = systemd.fstab_automounts(ROOT)
    elif op in ("enable", "disable"):
        for u in units:
            if not systemd.unit_file(ROOT, u) and u not in st.get("automounts", []):
                save(st)
                fail(f"Failed to {op} unit: Unit file {u} does not exist.")
            st.setdefault("enabled", {})[u] = op == "enable"
            if op == "enable" and now:
                start(st, u)
            if op == "disable" and now:
                st.setdefault("active", {}).pop(u, None)
    elif op in ("start", "restart"):
        for u in units:
            start(st, u)
    elif op == "stop":
        for u in units:
            st.setdefault("active", {}).pop(u, None)
    elif op == "is-active":
        save(st)
        raise SystemExit(0 if all(u in st.get("active", {}) for u in units) else 3)
    save(st)


def start(st: dict[str, Any], unit: str) -> None:
    if unit.endswith(".automount"):
        if unit not in st.get("automounts", []):
            save(st)
            fail(f"Failed to start {unit}: Unit {unit} not found.", 5)
        st.setdefault("active", {})[unit] = []
        return
    u = systemd.load_unit(ROOT, unit)
    if u is None:
        save(st)
        fail(f"Failed to start {unit}: Unit {unit} not found.", 5)
    if unit.endswith(".timer"):
        triggers = ("OnCalendar", "OnActiveSec", "OnBootSec", "OnStartupSec", "OnUnitActiveSec", "OnUnitInactiveSec")
        if not any(u.timer.get(k) for k in triggers):
            save(st)
            fail(f"Failed to start {unit}: {unit}: Timer unit lacks value setting. Refusing.")
        st.setdefault("active", {})[unit] = [v for k in triggers for v in u.timer.get(k, [])]
        return
    user = u.service.get("User", "")
    if user and not systemd.user_entry(ROOT, user):
        save(st)
        fail(f"Job for {unit} failed because the control process exited with error code.\n"
             f"(code=exited, status=217/USER: Failed to determine user credentials: No such process)")
    argv = systemd.exec_start(ROOT, u)
    kind = u.service.get("Type", "simple")
    # SchedMD: slurmd/slurmctld call sd_notify(READY=1) only when run with --systemd.
    if kind == "notify" and Path(argv[0]).name in ("slurmd", "slurmctld") and "--systemd" not in argv:
        save(st)
        fail(f"Job for {unit} failed because a timeout was exceeded.\n"
             f"See \"systemctl status {unit}\" and \"journalctl -xeu {unit}\" for details.")
    if unit == "munge.service":
        key = ROOT / "etc/munge/munge.key"
        owner = st.get("owners", {}).get("/etc/munge/munge.key", "")
        if not key.exists() or not owner.startswith("munge:"):
            save(st)
            fail("Job for munge.service failed: munged: Error: Keyfile is insecure or not owned by munge")
    st.setdefault("active", {})[unit] = argv


def findmnt(args: list[str]) -> None:
    st = load()
    path = strip_root(args[-1])
    unit = systemd.escape_path(path) + ".automount"
    ok = "lustre" in st.get("loaded", []) and unit in st.get("active", {})
    raise SystemExit(0 if ok else 1)


def mountpoint(args: list[str]) -> None:
    findmnt(args)


# --- users and ownership ---------------------------------------------------------------------------------

def getent(args: list[str]) -> None:
    db, name = args[0], args[1]
    line = systemd.user_entry(ROOT, name) if db == "passwd" else systemd.group_entry(ROOT, name)
    if not line:
        raise SystemExit(2)
    print(line)


def _opt(args: list[str], *names: str) -> str:
    for n in names:
        if n in args:
            return args[args.index(n) + 1]
    return ""


def groupadd(args: list[str]) -> None:
    name, gid = args[-1], _opt(args, "--gid", "-g")
    if systemd.group_entry(ROOT, name):
        fail(f"groupadd: group '{name}' already exists", 9)
    if gid and int(gid) in systemd.ids(ROOT, "group"):
        fail(f"groupadd: GID '{gid}' already exists", 4)
    gid = gid or str(max(systemd.ids(ROOT, "group") + [999]) + 1)
    systemd.add_line(ROOT / "etc/group", f"{name}:x:{gid}:")


def useradd(args: list[str]) -> None:
    name, uid, group = args[-1], _opt(args, "--uid", "-u"), _opt(args, "--gid", "-g")
    if systemd.user_entry(ROOT, name):
        fail(f"useradd: user '{name}' already exists", 9)
    if uid and int(uid) in systemd.ids(ROOT, "passwd"):
        fail(f"useradd: UID {uid} is not unique", 4)
    g = systemd.group_entry(ROOT, group) if group and not group.isdigit() else None
    if group and not group.isdigit() and not g:
        fail(f"useradd: group '{group}' does not exist", 6)
    gid = g.split(":")[2] if g else group
    uid = uid or str(max(systemd.ids(ROOT, "passwd") + [999]) + 1)
    systemd.add_line(ROOT / "etc/passwd", f"{name}:x:{uid}:{gid}::/home/{name}:/bin/bash")


def usermod(args: list[str]) -> None:
    user, groups = args[-1], _opt(args, "-aG", "-G").split(",")
    if not systemd.user_entry(ROOT, user):
        fail(f"usermod: user '{user}' does not exist", 6)
    lines = (ROOT / "etc/group").read_text().splitlines()
    for i, ln in enumerate(lines):
        f = ln.split(":")
        if f[0] in groups:
            members = [m for m in f[3].split(",") if m]
            if user not in members:
                f[3] = ",".join(members + [user])
            lines[i] = ":".join(f)
    (ROOT / "etc/group").write_text("\n".join(lines) + "\n")


def chown(args: list[str]) -> None:
    st = load()
    words = [a for a in args if not a.startswith("-")]
    spec, paths = words[0], words[1:]
    user, _, group = spec.partition(":")
    if user and not systemd.user_entry(ROOT, user):
        fail(f"chown: invalid user: '{spec}'")
    if group and not systemd.group_entry(ROOT, group):
        fail(f"chown: invalid group: '{spec}'")
    for p in paths:
        if not Path(p).exists():
            fail(f"chown: cannot access '{p}': No such file or directory")
        st.setdefault("owners", {})[strip_root(p)] = spec
    save(st)


def setfacl(args: list[str]) -> None:
    st = load()
    st.setdefault("acls", {})[strip_root(args[-1])] = args[-2]
    save(st)


def systemd_tmpfiles(args: list[str]) -> None:
    for ln in Path(args[-1]).read_text().splitlines():
        f = ln.split()
        if f and f[0] == "d":
            if not systemd.user_entry(ROOT, f[3]):
                fail(f"{args[-1]}: Failed to resolve user '{f[3]}': No such process")
            (ROOT / f[1].lstrip("/")).mkdir(parents=True, exist_ok=True)


def systemd_escape(args: list[str]) -> None:
    suffix = next((a.split("=", 1)[1] for a in args if a.startswith("--suffix=")), "")
    name = systemd.escape_path([a for a in args if not a.startswith("-")][-1])
    print(f"{name}.{suffix}" if suffix else name)


def hostname(args: list[str]) -> None:
    print(load().get("hostname", "node7"))


def logger(args: list[str]) -> None:
    st = load()
    log(st, "logger " + " ".join(args))
    save(st)


def write(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


TOOLS = {"apt-get": apt_get, "apt-cache": apt_cache, "apt-mark": apt_mark, "dpkg-query": dpkg_query, "dpkg": dpkg,
         "modprobe": modprobe, "modinfo": modinfo, "mokutil": mokutil, "dkms": dkms, "uname": uname,
         "systemctl": systemctl, "findmnt": findmnt, "mountpoint": mountpoint, "getent": getent, "groupadd": groupadd,
         "useradd": useradd, "usermod": usermod, "chown": chown, "setfacl": setfacl, "systemd-tmpfiles": systemd_tmpfiles, "systemd-escape": systemd_escape,
         "hostname": hostname, "logger": logger}

if __name__ == "__main__":
    TOOLS[sys.argv[1]](sys.argv[2:])
