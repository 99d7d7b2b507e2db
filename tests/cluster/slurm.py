"""A real Slurm on this machine for the tests: munged, slurmctld and one dynamic slurmd, all under
one temporary directory, from the slurm.conf that components/node/slurm_conf.py renders.

Everything private to the run: munge key and socket, state and spool directories, log files,
free ports (SlurmctldPort/SlurmdPort); clients find it through SLURM_CONF. The daemons run in the
foreground (-D / -F) as children of the test process, so teardown kills exactly them.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from components.node.slurm_conf import (
    SlurmConfInputs,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
    render_slurmd_defaults,
)
from tests.doubles.image import systemd

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")


def missing_binaries() -> list[str]:
    return [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None
            and not Path("/usr/sbin", b).exists()]


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass
class LocalSlurm:
    base: Path
    # production: the ND configuration (cgroup plugins, 8 GPUs per node); slurmctld only, since
    # this machine has neither GPUs nor a delegated cgroup tree for a slurmd.
    production: bool = False
    inputs: SlurmConfInputs | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def node(self) -> str:
        return socket.gethostname()

    def env(self, **extra: str) -> dict[str, str]:
        e = dict(os.environ)
        e["SLURM_CONF"] = str(self.conf)
        e.update(extra)
        return e

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout, check=check)

    def start(self, startup_timeout: float = 60.0) -> LocalSlurm:
        b = self.base
        for d in ("munge", "state", "spool", "log", "run", "etc"):
            (b / d).mkdir(parents=True, exist_ok=True)
        (b / "munge").chmod(0o700)
        key = b / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))    # munged(8): the key is any 32..1024 bytes
        key.chmod(0o400)
        sock = b / "munge" / "munge.sock"
        ctld_port, slurmd_port = _free_ports(2)
        health = b / "etc" / "health-check"
        health.write_text(f"#!/bin/sh\ndate +%s >> {self.health_log}\n")
        health.chmod(0o755)
        self.inputs = SlurmConfInputs(
            cluster_name="tiertest", controller_host=self.node, controller_addr="127.0.0.1", max_nodes=2,
            slurm_user="root", state_dir=str(b / "state"), spool_dir=str(b / "spool"),
            log_dir=str(b / "log"), run_dir=str(b / "run"), ctld_port=ctld_port, slurmd_port=slurmd_port,
            munge_socket=str(sock), health_check_program=str(health),
        )
        if not self.production:
            self.inputs = replace(self.inputs, gpus_per_node=0, kill_wait_s=30, test_mode=True)
        self.conf.write_text(render_slurm_conf(self.inputs))
        (b / "etc" / "gres.conf").write_text(render_gres_conf(self.inputs))
        (b / "etc" / "cgroup.conf").write_text(render_cgroup_conf(self.inputs))
        logs = b / "log"
        try:
            self._spawn([_bin("munged"), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                         f"--pid-file={b / 'munge' / 'munged.pid'}", f"--log-file={b / 'munge' / 'munged.log'}",
                         f"--seed-file={b / 'munge' / 'munged.seed'}"], logs / "munged.out")
            self._wait(lambda: sock.exists(), startup_timeout, "munged did not create its socket")
            self._spawn([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], logs / "slurmctld.out")
            self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, startup_timeout,
                       "slurmctld did not answer scontrol ping")
            if self.production:
                return self
            self._spawn([_bin("slurmd"), "-D", "-f", str(self.conf), *self.slurmd_options()], logs / "slurmd.out")
            self._wait(self._node_idle, startup_timeout, "the dynamic slurmd did not register as an idle node")
        except BaseException:
            self.stop()
            raise
        return self

    def slurmd_options(self) -> list[str]:
        """SLURMD_OPTIONS as a node's slurmd gets them: the /etc/default/slurmd its boot installs
        (render_slurmd_defaults), read and expanded the way systemd does for the packaged unit's
        `ExecStart=slurmd --systemd $SLURMD_OPTIONS` (Debian 22.05's unit here: `slurmd -D -s $SLURMD_OPTIONS`)."""
        assert self.inputs is not None
        (self.base / "etc" / "default-slurmd").write_text(render_slurmd_defaults(self.inputs))
        env = systemd.parse_env_file((self.base / "etc" / "default-slurmd").read_text())
        return systemd.expand("$SLURMD_OPTIONS", env)

    @property
    def health_log(self) -> Path:
        """One line per run of the HealthCheckProgram."""
        return self.base / "log" / "health-check.runs"

    def _node_idle(self) -> bool:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T %P", check=False)
        return any(line.split()[1:2] == ["idle"] for line in r.stdout.splitlines())

    def _spawn(self, argv: list[str], out: Path) -> None:
        with open(out, "ab") as f:
            self.procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env(),
                                               start_new_session=True))

    def _wait(self, ok: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    argv = p.args
                    name = Path(str(argv[0] if isinstance(argv, list) else argv)).name
                    raise RuntimeError(f"{name} exited with {p.returncode}: {self.logs()}")
            if ok():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout:.0f}s: {self.logs()}")

    def logs(self, tail: int = 30) -> str:
        parts = []
        for f in sorted((self.base / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel this cluster's jobs (their steps end through slurmd), then stop the daemons."""
        if self.procs and all(p.poll() is None for p in self.procs):
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = self.run("squeue", "-h", "-o", "%i", check=False, timeout=30)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        self.procs.clear()
