"""A real node for the e2e cluster: the kubelet with containerd, runc and CNI bridge networking.

Where the node stand-in (``e2e.node``) runs containers as host processes, this node runs
them for real: ``kubelet`` (built like the control plane, ``e2e/build.sh kubelet``) talks
CRI to a ``containerd`` of its own (Debian's 1.6, with runc), pods get their own network
namespaces on a CNI bridge, their own cgroups (memory limits, OOM kills), users,
capabilities and read-only root file systems. Opt-in: the ``real_node`` fixture starts
one for the tests that ask for it. It needs root and the Debian packages that
``e2e/build.sh node-packages`` installs.

What runs where (see e2e/README.md, "The real node"):

* a network namespace ``fm-<token>`` joined to the host by a veth pair, host end
  ``10.213.255.(4s+1)/30``, node end ``10.213.255.(4s+2)/30`` (``s``: this node's slot, one
  per session on the host); pods get ``10.213.s.0/24`` on a bridge inside. No route leaves
  those links: traffic stays between the host end, the node and its pods;
* a mount namespace private to the node (slave of the host's), with its own ``/run``,
  ``/var/lib`` and ``/var/log`` (containerd 1.6 keeps shim sockets under
  ``/run/containerd`` whatever its ``--state``; the kubelet writes
  ``/var/lib/kubelet/device-plugins`` and ``/var/log/containers`` whatever its
  ``--root-dir``) and with the six sysctls the kubelet insists on shown at its values,
  so that it does not rewrite the host's ``vm.overcommit_memory``, ``kernel.panic`` and
  ``kernel.panic_on_oops``. Every mount containerd and the kubelet make (image layers,
  pod volumes, pod network namespaces) lives there and goes when the node's processes do;
* containerd and the kubelet in both namespaces, with config, root, state and sockets in
  ``/tmp/flowmill-realnode-<random>/``; pods' cgroups under ``/flowmill-realnode-<token>``
  in each cgroup hierarchy;
* a port forward on the host end of the veth to the apiserver's 127.0.0.1 port (TLS passes
  through; the kubelet's kubeconfig names the apiserver certificate's DNS name).

``stop()`` kills the kubelet, every container process (by cgroup), containerd and its
shims (by command line), removes the cgroups, the network namespace, the veth, the state,
and the node's pods and Node object from the cluster; ``sweep_stale_nodes()`` does the
same for a node whose test session was killed.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .addons import CLUSTER_DOMAIN, Addons
from .addons import binaries as addon_binaries
from .kubeconfig import write_kubeconfig
from .ociimage import BUSYBOX, Image, write_archive
from .pki import issue_kubelet_certs
from .procs import Proc, orphaned, stop_all, wait_for
from .versions import kubelet_binary

if TYPE_CHECKING:
    from .cluster import Cluster

HERE = Path(__file__).resolve().parent
NODE_NAME = "real-0"
KIND_LABEL = "flowmill.dev/node-kind"
KIND = "real"
STATE_PREFIX = "flowmill-realnode-"
NET = "10.213"  # a /16 away from the usual defaults; each slot is checked against routes
SLOTS = 64
API_PORT = 6443
CNI_BIN = Path("/usr/lib/cni")
BUSYBOX_IMAGE = "flowmill.local/busybox:e2e"
PAUSE_IMAGE = "flowmill.local/pause:e2e"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the kubelet's container manager sets these to, unless protectKernelDefaults (then it
# refuses to start): shown to it at these values in the node's mount namespace.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": 1, "vm/panic_on_oom": 0, "kernel/panic": 10,
    "kernel/panic_on_oops": 1, "kernel/keys/root_maxkeys": 1000000,
    "kernel/keys/root_maxbytes": 25000000,
}
TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "iptables", "nsenter",
         "unshare", "mount", "sleep")
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def missing_requirements() -> list[str]:
    """What this host lacks to run a real node (empty: it can)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (network namespaces, mounts, cgroups)")
    out += [t for t in TOOLS if shutil.which(t, path=PATH) is None]
    out += [str(CNI_BIN / p) for p in ("bridge", "host-local", "loopback")
            if not (CNI_BIN / p).exists()]
    if not BUSYBOX.exists():
        out.append(f"{BUSYBOX} (busybox-static)")
    if not os.access(kubelet_binary(), os.X_OK):
        out.append(f"{kubelet_binary()} (e2e/build.sh kubelet)")
    out += [f"{path} (e2e/build.sh {name})" for name, path in addon_binaries().items()
            if not os.access(path, os.X_OK)]
    if not Path("/sys/fs/cgroup/memory").is_dir() and not Path(
            "/sys/fs/cgroup/cgroup.controllers").exists():
        out.append("a cgroup memory controller")
    return out


@dataclass(frozen=True)
class Slot:
    """Addresses of one real node on this host."""

    n: int

    @property
    def host_ip(self) -> str:
        return f"{NET}.255.{4 * self.n + 1}"

    @property
    def node_ip(self) -> str:
        return f"{NET}.255.{4 * self.n + 2}"

    @property
    def link(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{NET}.255.{4 * self.n}/30")

    @property
    def pods(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{NET}.{self.n}.0/24")


def _routes() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"],
                         capture_output=True, text=True, check=True)
    nets = []
    for r in json.loads(out.stdout or "[]"):
        dst = r.get("dst", "default")
        if dst != "default":
            nets.append(ipaddress.IPv4Network(dst, strict=False))
    return nets


def claim_slot() -> tuple[Slot, socket.socket]:
    """A slot no other node on this host holds and whose ranges no route covers.

    Held by binding an abstract unix socket for the session's lifetime (released by the
    kernel whatever way the process ends).
    """
    routes = _routes()
    for n in range(SLOTS):
        slot = Slot(n)
        if any(r.overlaps(slot.link) or r.overlaps(slot.pods) for r in routes):
            continue
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0flowmill-realnode-slot-{n}")
        except OSError:
            claim.close()
            continue
        return slot, claim
    raise RuntimeError(f"no free slot for a real node in {NET}.0.0/16: all taken or routed")


def _run(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PATH": PATH})
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
    return out


# -- clean-up, shared by stop() and the sweep of crashed sessions ------------------------


def _cgroup_mounts() -> list[Path]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] in ("cgroup", "cgroup2"):
            mounts.append(Path(left.split(" ")[4]))
    return mounts


def _cgroup_dirs(cgroup: str) -> list[Path]:
    """The node's cgroup folders in every hierarchy, deepest first."""
    dirs = []
    for m in _cgroup_mounts():
        top = m / cgroup.lstrip("/")
        if top.is_dir():
            dirs += [Path(d) for d, _, _ in os.walk(top)]
    return sorted(dirs, key=lambda p: len(p.parts), reverse=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _cgroup_pids(cgroup: str) -> set[int]:
    pids: set[int] = set()
    for d in _cgroup_dirs(cgroup):
        try:
            pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return pids


def _pids_mentioning(text: str) -> set[int]:
    """Processes whose command line contains ``text`` (containerd, its shims, the kubelet)."""
    me = os.getpid()
    found = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == me:
            continue
        try:
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.add(int(p.name))
    return found


def _mounts_under(root: Path) -> list[str]:
    out = []
    prefix = str(root).rstrip("/") + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split(" ")[4].replace("\\040", " ")
        if point == str(root) or point.startswith(prefix):
            out.append(point)
    return sorted(out, key=len, reverse=True)


def teardown(state: Path, info: dict) -> list[str]:
    """Leave nothing of a node behind; return what could not be removed."""
    problems: list[str] = []
    cgroup, token = info.get("cgroup"), info.get("token")
    # Containers first (they have no other parent left once their shim goes), then every
    # process naming the state folder (kubelet, containerd, shims), until none is left.
    deadline = time.monotonic() + 20
    while True:
        pids = (_cgroup_pids(cgroup) if cgroup else set()) | _pids_mentioning(f"{state}/")
        if not pids:
            break
        if time.monotonic() > deadline:
            problems.append(f"processes still alive: {sorted(pids)}")
            break
        for pid in pids:
            _kill(pid)
        time.sleep(0.2)
    # The node's mounts live in its own mount namespace and went with its processes; any
    # that reached the host's (there should be none) are detached here.
    for point in _mounts_under(state):
        if _libc.umount2(point.encode(), _MNT_DETACH) != 0:
            problems.append(f"umount {point}: errno {ctypes.get_errno()}")
    if cgroup:
        for _ in range(50):
            left = []
            for d in _cgroup_dirs(cgroup):
                try:
                    d.rmdir()
                except OSError:
                    left.append(d)
            if not left:
                break
            time.sleep(0.1)
        else:
            problems.append(f"cgroups left: {left}")
    if token:
        _run("ip", "netns", "delete", f"fm-{token}", check=False)
        _run("ip", "link", "delete", f"fmh-{token}", check=False)
    shutil.rmtree(state, ignore_errors=True)
    return problems


def sweep_stale_nodes() -> None:
    """Tear down real nodes whose test session died without stopping them."""
    for d in orphaned(STATE_PREFIX):
        try:
            info = json.loads((d / "node.json").read_text())
        except (OSError, ValueError):
            info = {}
        teardown(d, info)


# -- the node ------------------------------------------------------------------------------


class RealNode:
    """Start/stop a real node registered with ``cluster``; helpers for images and ``ctr``."""

    def __init__(self, cluster: Cluster, name: str = NODE_NAME) -> None:
        self.cluster = cluster
        self.name = name
        self.procs: list[Proc] = []
        self.state: Path | None = None
        self.slot: Slot | None = None
        self._claim: socket.socket | None = None
        self.token = secrets.token_hex(4)
        self.netns = f"fm-{self.token}"
        self.veth = f"fmh-{self.token}"
        self.cgroup = f"/flowmill-realnode-{self.token}"
        self.log_dir = cluster.log_dir / f"realnode-{name}"
        self.start_seconds: float | None = None
        self.addons = Addons(self)

    # -- paths -------------------------------------------------------------------------

    @property
    def _state(self) -> Path:
        assert self.state is not None, "real node not started"
        return self.state

    @property
    def containerd_socket(self) -> Path:
        return self._state / "containerd.sock"

    @property
    def node_ip(self) -> str:
        assert self.slot is not None
        return self.slot.node_ip

    @property
    def host_ip(self) -> str:
        """The host end of the node's veth: where the node reaches the host's forwards."""
        assert self.slot is not None
        return self.slot.host_ip

    api_port = API_PORT  # the apiserver's forward, on host_ip

    @property
    def pod_cidr(self) -> ipaddress.IPv4Network:
        assert self.slot is not None
        return self.slot.pods

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> RealNode:
        missing = missing_requirements()
        if missing:
            raise RuntimeError(f"a real node needs: {missing}")
        t0 = time.monotonic()
        sweep_stale_nodes()
        self.state = Path(tempfile.mkdtemp(prefix=STATE_PREFIX))
        self.state.chmod(0o755)  # the pods' non-root users traverse it to their volumes
        # Written before anything exists, so a sweep after a crash finds all of it.
        (self.state / "owner.pid").write_text(str(os.getpid()))
        (self.state / "node.json").write_text(json.dumps(
            {"token": self.token, "cgroup": self.cgroup, "name": self.name}))
        try:
            self.slot, self._claim = claim_slot()
            self._network()
            kubeconfig = self._credentials()
            self._forward(API_PORT, self.cluster.api_port, "apiserver")
            holder = self._start_namespace_holder(timeout)
            self._start_containerd(holder, timeout)
            self.import_archive(self._write_images())
            self._start_kubelet(holder, kubeconfig)
            wait_for(f"node {self.name} Ready", self._ready, timeout, self.procs)
            self.addons.start(holder, timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        (self.log_dir / "start-seconds.txt").write_text(f"{self.start_seconds:.1f}\n")
        return self

    def stop(self) -> list[str]:
        """Stop everything and remove all state; return what could not be cleaned."""
        problems: list[str] = []
        kubelet = [p for p in self.procs if p.name == "kubelet"]
        stop_all(kubelet)  # first, so it restarts nothing
        stop_all([p for p in self.procs if p.name == "containerd"])
        if self.state is not None:
            problems = teardown(self.state, {"token": self.token, "cgroup": self.cgroup})
        else:
            _run("ip", "netns", "delete", self.netns, check=False)
            _run("ip", "link", "delete", self.veth, check=False)
        stop_all(self.procs)
        self.procs.clear()
        if self._claim is not None:
            self._claim.close()
            self._claim = None
        # Nothing of it stays in the cluster either: the `kubernetes` Service's endpoint,
        # its pods (no kubelet will confirm their deletion now) and the Node, so that a
        # later node of the same name starts afresh.
        self.addons.stop()
        self.cluster.kubectl("delete", "pods", "--all-namespaces", "--field-selector",
                             f"spec.nodeName={self.name}", "--force", "--grace-period=0",
                             "--ignore-not-found", check=False, timeout=60)
        self.cluster.kubectl("delete", "node", self.name, "--ignore-not-found", check=False,
                             timeout=60)
        self.state = None
        return problems

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- parts -------------------------------------------------------------------------

    def spawn(self, name: str, argv: list[str | os.PathLike[str]], grace: float = 10.0) -> Proc:
        """A process of the node's, on the host; stopped with the node."""
        p = Proc(name, argv, self.log_dir / f"{name}.log", env={**os.environ, "PATH": PATH},
                 cwd=self._state, grace=grace)
        self.procs.append(p)
        return p

    def spawn_inside(self, name: str, holder: Proc, argv: list[str | os.PathLike[str]],
                     grace: float = 10.0) -> Proc:
        """A process of the node's in its network and mount namespaces."""
        return self.spawn(name, [*self._enter(holder), *argv], grace)

    def _network(self) -> None:
        """The node's network namespace and its veth to the host; nothing routes further."""
        s = self.slot
        assert s is not None
        plen = s.link.prefixlen
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0",
             "netns", self.netns)
        _run("ip", "addr", "add", f"{s.host_ip}/{plen}", "dev", self.veth)
        _run("ip", "link", "set", self.veth, "up")
        # Replies to pods (a pod talking to the host end) go back through the node.
        _run("ip", "route", "add", str(s.pods), "via", s.node_ip, "dev", self.veth)
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")
        _run("ip", "-n", self.netns, "addr", "add", f"{s.node_ip}/{plen}", "dev", "eth0")
        _run("ip", "-n", self.netns, "link", "set", "eth0", "up")

    def _credentials(self) -> Path:
        pki = self.cluster.pki
        assert pki is not None
        serving, client = issue_kubelet_certs(pki, self.name, self.node_ip)
        self._serving = serving
        kubeconfig = self._state / "kubelet.kubeconfig"
        # The apiserver's certificate names 127.0.0.1 and `kubernetes...`, not this address.
        write_kubeconfig(kubeconfig, f"https://{self.slot.host_ip}:{API_PORT}", pki.ca_crt,
                         cert=pki.crt(client), key=pki.key(client),
                         user=f"system:node:{self.name}", tls_server_name="kubernetes")
        return kubeconfig

    def _forward(self, port: int, target: int, what: str) -> None:
        p = self.spawn(f"{what}-forward", [
            sys.executable, HERE / "tcpforward.py", self.host_ip, str(port),
            "127.0.0.1", str(target)], grace=1.0)

        def listening() -> bool:
            with socket.create_connection((self.host_ip, port), timeout=1):
                return True
        wait_for(f"the {what} port forward", listening, 30, [p])

    def expose(self, port: int, what: str) -> str:
        """Make the host's 127.0.0.1:``port`` reachable from the node's pods (a service
        outside the cluster, as S3 is); returns the address they dial."""
        self._forward(port, port, what)
        return f"{self.host_ip}:{port}"

    def _start_namespace_holder(self, timeout: float) -> Proc:
        """A process that opens the node's mount namespace (see the module docstring)."""
        sysctl = self._state / "sysctl"
        sysctl.mkdir()
        # Paths the kubelet and containerd write whatever their flags say: /run/containerd
        # (containerd 1.6: shim sockets), /var/lib/kubelet/device-plugins, /var/lib/cni
        # (CNI result cache), /var/log/containers (the kubelet's log symlinks).
        lines = ["set -e"] + [f"mount -t tmpfs -o mode=0755,size=64m flowmill-realnode {d}"
                              for d in ("/run", "/var/lib", "/var/log")]
        for key, value in KUBELET_SYSCTLS.items():
            f = sysctl / key.replace("/", ".")
            f.write_text(f"{value}\n")
            lines.append(f"mount --bind -o ro {f} /proc/sys/{key}")
        ready = self._state / "namespace.ready"
        lines += [f"touch {ready}", "exec sleep infinity"]
        p = self.spawn("namespaces", [
            "nsenter", f"--net=/run/netns/{self.netns}", "--",
            "unshare", "--mount", "--propagation", "slave", "--",
            "sh", "-c", "\n".join(lines)], grace=1.0)
        wait_for("the node's mount namespace", ready.exists, timeout, [p])
        return p

    def _enter(self, holder: Proc) -> list[str]:
        return ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt",
                f"--net=/proc/{holder.pid}/ns/net", "--"]

    def _start_containerd(self, holder: Proc, timeout: float) -> None:
        st = self._state
        cni_conf = st / "cni" / "net.d"
        cni_conf.mkdir(parents=True)
        (cni_conf / "10-flowmill.conflist").write_text(json.dumps(self._cni_config(), indent=1))
        cfg = st / "containerd.toml"
        cfg.write_text(self._containerd_config(cni_conf))
        p = self.spawn_inside("containerd", holder, ["containerd", "--config", cfg], grace=5.0)

        def answers() -> bool:
            return self.ctr("version", check=False).returncode == 0
        wait_for("containerd", answers, timeout, [p, holder])

    def _cni_config(self) -> dict:
        pods = self.slot.pods
        return {
            "cniVersion": "1.0.0", "name": "flowmill-realnode",
            "plugins": [{
                "type": "bridge", "bridge": "fmbr0", "isGateway": True, "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local", "dataDir": str(self._state / "cni" / "ipam"),
                    "ranges": [[{"subnet": str(pods), "gateway": str(pods[1])}]],
                    # The node's /16 and the Services' range (kube-proxy's rules are in
                    # the node): no default route, nothing leaves the node's links.
                    "routes": [{"dst": f"{NET}.0.0/16"}, {"dst": self.cluster.service_cidr}],
                },
            }],
        }

    def _containerd_config(self, cni_conf: Path) -> str:
        st = self._state
        return f"""\
version = 2
root = "{st / 'containerd' / 'root'}"
state = "{st / 'containerd' / 'state'}"
oom_score = 0
# Not needed here, and would make folders outside the node's state.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{self.containerd_socket}"

[ttrpc]
  address = "{st / 'containerd.ttrpc.sock'}"

[plugins."io.containerd.grpc.v1.cri"]
  # No registry is reachable: the sandbox image is imported (e2e.ociimage).
  sandbox_image = "{PAUSE_IMAGE}"
  # The pause container asks for oom_score_adj -998, which needs CAP_SYS_RESOURCE; without
  # this runc fails with "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  # Pod network namespaces are mounted under the state folder, not /var/run/netns.
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_unprivileged_ports = false
  enable_unprivileged_icmp = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{shutil.which('runc', path=PATH)}"
        Root = "{st / 'runc'}"
        SystemdCgroup = false
"""

    def _write_images(self) -> Path:
        archive = self._state / "images.tar"
        write_archive(archive, [
            Image(BUSYBOX_IMAGE),
            # The sandbox ("pause") container: holds the pod's namespaces, does nothing.
            Image(PAUSE_IMAGE, cmd=[], entrypoint=["/bin/sleep", "2147483647"],
                  user="65535:65535"),
        ])
        return archive

    def _start_kubelet(self, holder: Proc, kubeconfig: Path) -> None:
        st = self._state
        pki = self.cluster.pki
        assert pki is not None
        endpoint = f"unix://{self.containerd_socket}"
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.node_ip, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "tlsCertFile": str(pki.crt(self._serving)),
            "tlsPrivateKeyFile": str(pki.key(self._serving)),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca_crt)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": endpoint, "imageServiceEndpoint": endpoint,
            # cgroup v1 (failCgroupV1: the kubelet refuses it by default since 1.35) through
            # cgroupfs (no systemd here). The QoS hierarchy is on so that pods' cgroups go
            # under this node's own cgroupRoot (kubepods/<qos>/pod<uid>/<container>), which
            # the clean-up removes; with it off the kubelet passes no parent and containerd
            # uses /k8s.io/<id>, shared with any other containerd on the host. Node
            # allocatable is not enforced: the host is shared with other work.
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True,
            "cgroupRoot": self.cgroup, "enforceNodeAllocatable": [],
            "failSwapOn": False, "localStorageCapacityIsolation": False,
            "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE
            "protectKernelDefaults": False,
            "podLogsDir": str(st / "pod-logs"),
            "volumePluginDir": str(st / "volume-plugins"),
            "resolvConf": "",  # no host resolvers in pods: nothing to reach them by
            # CoreDNS (e2e.addons) on the node's address: the cluster's names only.
            "clusterDNS": [self.node_ip], "clusterDomain": CLUSTER_DOMAIN,
            "registerNode": True,
            "registerWithTaints": [{"key": KIND_LABEL, "value": KIND, "effect": "NoSchedule"}],
            "maxPods": 20,
            # Images are imported, never pulled: never collect them; only evict on real
            # exhaustion (the host is shared with other work).
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "makeIPTablesUtilChains": False,
            "serializeImagePulls": False,
        }
        for m in _cgroup_mounts():
            (m / self.cgroup.lstrip("/")).mkdir(exist_ok=True)
        cfg = st / "kubelet.json"
        cfg.write_text(json.dumps(config, indent=1))
        self.spawn_inside("kubelet", holder, [
            kubelet_binary(),
            f"--config={cfg}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}", f"--node-ip={self.node_ip}",
            f"--node-labels={KIND_LABEL}={KIND}",
            f"--root-dir={st / 'kubelet'}", f"--cert-dir={st / 'kubelet-pki'}",
            "--v=2",
        ])

    def _ready(self) -> bool:
        node = self.cluster.get("node", self.name)
        conds = (node or {}).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    # -- helpers for tests -------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against this node's containerd, in the ``k8s.io`` (CRI) namespace."""
        return _run("ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io",
                    *args, check=check, timeout=timeout)

    def import_archive(self, archive: Path) -> None:
        """Import an image archive (OCI or ``docker save``/``podman save``) for pods to use
        with ``imagePullPolicy: Never``."""
        self.ctr("images", "import", str(archive))

    def signal_container(self, pod: dict, sig: int, container: str | None = None) -> int:
        """Signal every process of a pod's container (its first, or the one named), found
        by its cgroup on this node, as a lost node or the OOM killer would end them;
        returns how many were signalled."""
        statuses = pod.get("status", {}).get("containerStatuses") or []
        (status,) = [c for c in statuses if container in (None, c["name"])][:1] or [None]
        if status is None or not status.get("containerID"):
            raise RuntimeError(f"pod {pod['metadata']['name']} has no running container")
        cid = status["containerID"].split("://", 1)[1]
        pids: set[int] = set()
        for d in _cgroup_dirs(self.cgroup):
            if d.name == cid:
                try:
                    pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
                except OSError:
                    pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)

    def netns_inode(self) -> int:
        """Inode of the node's network namespace (pods must each have another)."""
        return os.stat(f"/run/netns/{self.netns}").st_ino
