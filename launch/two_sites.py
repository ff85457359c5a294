"""Two sites on one machine, really apart: each replica group of diloco.py in a network namespace of its own, the
two joined by a veth pair whose both ends `tc ... tbf rate R` shapes. Needs root (ip netns, tc) and Linux.

    sudo python launch/two_sites.py --rate 20mbit -- --algorithm diloco --sync_every 50 --steps 1000
    sudo python launch/two_sites.py --rate 1gbit -- --algorithm localsgd --sync_every 1 --steps 1000 --log_every 50
    sudo python launch/two_sites.py --rate 20mbit --min_replicas 1 --kill_site 1 --kill_after_sync 5 \
        --restart_after 3 -- --sync_every 50 --steps 1000       # site 1 dies after its 5th sync, comes back

Site 0 is namespace ddpsite0-<pid> at 10.214.<n>.1, site 1 ddpsite1-<pid> at 10.214.<n>.2; the lighthouse runs in
site 0, so site 1's heartbeats and quorums cross the link as its gradients do. Everything binds inside the
namespaces. Each site runs `torchrun --standalone --nproc_per_node=1 diloco.py --replica_id N --host <its address>
--lighthouse http://10.214.<n>.1:29510 --snapshot_path site<N>.pt <the flags after -->`; the lines of both come
out prefixed with [site N]. At the end it prints the bytes that crossed the link, read from the veth's counters
(`ip -s link`): what the sync sent, and the TCP, quorum and heartbeat traffic around it. Then it deletes the
namespaces, which takes the veth pair, the shaping and any process left in them along.
`--min_replicas 2` (the default) has the lighthouse wait for both sites before the first sync; 1 lets a site sync
alone when the other is down. docs/slow-links.md has the measured runs.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # torchrun and torchft_lighthouse are installed beside this python
LIGHTHOUSE_PORT = 29510
HOLD_RATE = "32kbit"  # the link's rate from the sync line of --kill_after_sync to a --mid_sync kill


class Sites:
    """The two namespaces and the shaped veth pair between them; a context manager that tears it all down."""

    def __init__(self, rate, tag=None):
        tag = tag or str(os.getpid())
        self.rate = rate
        self.names = [f"ddpsite0-{tag}", f"ddpsite1-{tag}"]
        self.links = [f"ddps0-{tag}"[:15], f"ddps1-{tag}"[:15]]  # interface names: at most 15 characters
        subnet = int(tag) % 250 if tag.isdigit() else 1
        self.addresses = [f"10.214.{subnet}.1", f"10.214.{subnet}.2"]

    def __enter__(self):
        try:
            for name in self.names:
                ip("netns", "add", name)
            ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, self.addresses):
                ip("link", "set", link, "netns", name)
                ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                ip("-n", name, "link", "set", link, "up")
                ip("-n", name, "link", "set", "lo", "up")
            self.shape(self.rate, "add")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for name in self.names:  # kills what still runs inside, and takes the veth pair and its shaping along
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def shape(self, rate, verb="change"):
        """Both ends of the veth pair at `rate` each way (a change drops the packets that wait)."""
        for name, link in zip(self.names, self.links):
            # tbf: a token bucket, `rate` on average; the bucket holds 10 ms of it (64 KB at least: one TSO
            # segment), and a packet waits at most 100 ms for tokens before it is dropped (TCP sends it again).
            run(["ip", "netns", "exec", name, "tc", "qdisc", verb, "dev", link, "root", "tbf", "rate", rate,
                 "burst", str(max(65536, bits(rate) // 800)), "latency", "100ms"])

    def drain(self, site, keep=(), timeout=10):
        """Wait until no process but `keep` is left in the site and its end of the link has sent what waited then:
        the RST of a killed process's socket is sent once, and a shape() before it leaves would drop it."""
        deadline = time.monotonic() + timeout
        pids = ["ip", "netns", "pids", self.names[site]]
        while set(map(int, run(pids).split())) - set(keep) and time.monotonic() < deadline:
            time.sleep(0.02)
        qdisc = ["ip", "netns", "exec", self.names[site], "tc", "-s", "-j", "qdisc", "show", "dev", self.links[site]]
        stats = json.loads(run(qdisc))[0]
        while json.loads(run(qdisc))[0]["packets"] < stats["packets"] + stats["qlen"] and time.monotonic() < deadline:
            time.sleep(0.02)

    def sent(self):
        """Bytes each end of the veth pair has sent so far: [site 0 to 1, site 1 to 0]."""
        out = []
        for name, link in zip(self.names, self.links):
            stats = json.loads(run(["ip", "-n", name, "-s", "-j", "link", "show", "dev", link]))[0]
            out.append(stats["stats64"]["tx"]["bytes"])
        return out

    def command(self, site, argv, env=None):
        """argv run inside the site's namespace; gloo told which interface to use (the host name's address is not
        in the namespace)."""
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR",  # else c10d warns that no name resolves to the namespace's address
               **(env or os.environ), "GLOO_SOCKET_IFNAME": self.links[site], "PYTHONUNBUFFERED": "1"}
        return ["ip", "netns", "exec", self.names[site], *map(str, argv)], env

    def lighthouse(self, min_replicas, cwd):
        argv, env = self.command(0, [BIN / "torchft_lighthouse", "--bind", f"{self.addresses[0]}:{LIGHTHOUSE_PORT}",
                                     "--min_replicas", min_replicas, "--join_timeout_ms", "1000",
                                     "--heartbeat_timeout_ms", "2000"])
        process = subprocess.Popen(argv, env={**env, "RUST_LOG": "warn"}, cwd=cwd, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while f":{LIGHTHOUSE_PORT:04X} " not in namespace_listeners(self.names[0]):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: torchft_lighthouse did not start in {self.names[0]}")
            time.sleep(0.05)
        return process

    def group(self, site, script, flags, cwd, env=None):
        argv, env = self.command(site, [BIN / "torchrun", "--standalone", "--nproc_per_node=1", REPO / script,
                                        "--replica_id", site, "--host", self.addresses[site],
                                        "--lighthouse", f"http://{self.addresses[0]}:{LIGHTHOUSE_PORT}",
                                        "--snapshot_path", f"site{site}.pt", *flags], env)
        return Group(site, argv, env, cwd)


class Group:
    """One site's torchrun; its lines kept with the time each arrived, and echoed with the site in front."""

    def __init__(self, site, argv, env, cwd, echo=True):
        self.site, self.echo, self.lines, self.arrived = site, echo, [], threading.Condition()
        self.process = subprocess.Popen(argv, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self.arrived:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.arrived.notify_all()
            if self.echo:
                print(f"[site {self.site}] {line}", end="", flush=True)
        with self.arrived:
            self.arrived.notify_all()

    def wait_for(self, pattern, timeout, since=0):
        """The first line from line `since` on that matches `pattern`; None if the group ended or `timeout` passed
        first."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                for _, line in self.lines[since:]:
                    if re.search(pattern, line):
                        return line
                if (self.process.poll() is not None and not self.reader.is_alive()) or time.monotonic() > deadline:
                    return None
                self.arrived.wait(0.1)

    def kill(self):
        """SIGKILL the site's torchrun and its worker: the site dies as a machine would."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.reader.join(10)

    def finish(self, timeout):
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(10)
        return self.process.returncode


def ip(*args):
    run(["ip", *args])


def run(argv):
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv)}: {result.stderr.strip()} (this needs root, iproute2 and tc)")
    return result.stdout


def bits(rate):
    """tc's rate syntax (20mbit, 1gbit, 500kbit) in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(rate)
    return int(float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]])


def namespace_listeners(name):
    """/proc/net/tcp as a process inside the namespace sees it."""
    return subprocess.run(["ip", "netns", "exec", name, "cat", "/proc/net/tcp"], capture_output=True,
                          text=True).stdout


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="20mbit", help="the link's rate each way, in tc's syntax (20mbit)")
    parser.add_argument("--script", default="diloco.py", help="what each site runs (default diloco.py)")
    parser.add_argument("--min_replicas", type=int, default=2, choices=[1, 2],
                        help="the lighthouse's: 2 waits for both sites before the first sync (default 2)")
    parser.add_argument("--kill_site", type=int, choices=[0, 1], help="SIGKILL this site's group mid-run")
    parser.add_argument("--kill_after_sync", type=int, default=5, help="... after its Nth sync line (5)")
    parser.add_argument("--mid_sync", action="store_true",
                        help="... and only once its next sync is under way (64 KB more sent; the link slowed to "
                             f"{HOLD_RATE} meanwhile, so that the kill lands in it): a lost sync")
    parser.add_argument("--restart_after", type=float,
                        help="start the killed site again this many seconds after the other's first sync alone")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the whole run may take (600)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the flags every site's script gets")
    args = parser.parse_args(argv)
    args.flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    try:
        bits(args.rate)
    except ValueError:
        parser.error(f"--rate {args.rate!r} is not a rate tc reads, such as 20mbit or 1gbit")
    if args.kill_site is not None and args.min_replicas != 1:
        parser.error("--kill_site needs --min_replicas 1: the other site must be let sync alone")
    if sys.platform != "linux" or os.geteuid() != 0:
        parser.error("network namespaces and tc need Linux and root: run it with sudo")
    return args


def main(args):
    cwd = os.getcwd()
    with Sites(args.rate) as sites:
        lighthouse = sites.lighthouse(args.min_replicas, cwd)
        print(f"Sites: {sites.names[0]} {sites.addresses[0]} (lighthouse) | {sites.names[1]} {sites.addresses[1]} | "
              f"link {args.rate} each way (tc tbf)", flush=True)
        began, before = time.monotonic(), sites.sent()
        groups = [sites.group(site, args.script, args.flags, cwd) for site in (0, 1)]
        if args.kill_site is not None:
            victim = groups[args.kill_site]
            line = victim.wait_for(rf"^Sync {args.kill_after_sync} \| step", args.timeout)
            if line is None:
                raise SystemExit(f"error: site {args.kill_site} ended before its sync {args.kill_after_sync}")
            if args.mid_sync:  # its next sync sends: wait until some of it has crossed
                # On a link slowed from now to the kill: the bucket's 64 KB pass at once, the rest of the sync takes
                # many seconds, so the kill lands in it however long it takes to come (at --rate the sync can be over
                # in a blink, before a busy machine's kill). The heartbeats and the next quorum pass the slow link.
                mark = sites.sent()[args.kill_site]
                sites.shape(HOLD_RATE)
                while sites.sent()[args.kill_site] < mark + 65536 and victim.process.poll() is None:
                    time.sleep(0.01)
            other = groups[1 - args.kill_site]
            seen = len(other.lines)  # its lines from here on come after the kill
            victim.kill()
            if args.mid_sync:
                sites.drain(args.kill_site, keep=[lighthouse.pid])
                sites.shape(args.rate)
            print(f"Killed site {args.kill_site} (SIGKILL) after its sync {args.kill_after_sync}", flush=True)
            if args.restart_after is not None:
                # Counted from the other site's first sync without it. The lighthouse forms a quorum of more than
                # half of the groups it hears heartbeats from. A group started again at once heartbeats before its
                # first sync: the other's next sync could wait for it and be the two's (a race with how soon the
                # other noticed the death).
                other.wait_for(r"^Sync \d+ \| step \d+ \| groups 1 ", args.timeout, since=seen)
                time.sleep(args.restart_after)
                groups[args.kill_site] = sites.group(args.kill_site, args.script, args.flags, cwd)
        codes = [group.finish(max(1, args.timeout - (time.monotonic() - began))) for group in groups]
        after = sites.sent()
        lighthouse.kill()
        wall = time.monotonic() - began
        print(f"Link: {args.rate} | site 0 to 1 {(after[0] - before[0]) / 1e6:.2f} MB | site 1 to 0 "
              f"{(after[1] - before[1]) / 1e6:.2f} MB (the veth's counters) | wall {wall:.1f}s | exit codes "
              f"{codes[0]} {codes[1]}", flush=True)
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main(parse_args()))
