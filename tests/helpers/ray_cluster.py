"""A two-node Ray cluster on this machine, started the way a real one is: ``ray start --head`` and a second ``ray start
--address``, each node with its own logical GPUs, a private temp dir and ports of its own (so it neither meets nor
disturbs any other Ray instance on the machine).

:func:`local_cluster` yields the head's address and stops exactly the processes the two ``ray start`` commands left
running (found by the private temp dir in their command lines, plus their descendants), by pid, even when the test
fails. ``ray stop`` would stop every Ray instance of this user on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports from below the ephemeral range (a released ``bind(0)`` port can be handed to any
    other process before ``ray start`` binds it)."""
    from rlhf_ext.openrlhf.compat import free_port

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _node_ports() -> list[str]:
    names = ("--node-manager-port", "--object-manager-port", "--metrics-export-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port")  # fmt: skip
    return [f"{name}={port}" for name, port in zip(names, _free_ports(len(names)))]


def _ours(temp_dir: str) -> list[psutil.Process]:
    """The processes whose command line names ``temp_dir``, and all their descendants."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
    found.pop(os.getpid(), None)
    return list(found.values())


def _stop(temp_dir: str) -> None:
    procs = _ours(temp_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=15)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


@contextlib.contextmanager
def local_cluster(gpus_per_node: int = 1, cpus_per_node: int = 4) -> Iterator[str]:
    """Two nodes of ``gpus_per_node`` logical GPUs; yields the address to put in ``RAY_ADDRESS``."""
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths must stay under 108 chars
    gcs, client = _free_ports(2)
    address = f"127.0.0.1:{gcs}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus_per_node}", f"--num-gpus={gpus_per_node}",
              "--disable-usage-stats"]  # fmt: skip
    ray = str(Path(sys.executable).with_name("ray"))  # the venv's ray, whatever PATH says
    try:
        head = [ray, "start", "--head", f"--port={gcs}", f"--ray-client-server-port={client}",
                f"--temp-dir={temp_dir}", "--include-dashboard=false", *common, *_node_ports()]  # fmt: skip
        subprocess.run(head, check=True, capture_output=True, text=True, timeout=180, env=env)
        worker = [ray, "start", f"--address={address}", *common, *_node_ports()]
        subprocess.run(worker, check=True, capture_output=True, text=True, timeout=180, env=env)
        _wait_for_nodes(address, 2, env)
        yield address
    finally:
        _stop(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_nodes(address: str, n: int, env: dict[str, str], timeout: float = 120) -> None:
    code = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for x in ray.nodes() if x['Alive']))"
    )
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, env=env)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the local Ray cluster at {address} did not reach {n} nodes: {out.stderr[-2000:]}")
        time.sleep(2)


def actor_nodes(address: str) -> list[dict[str, str]]:
    """Every actor the cluster has run (alive or dead): class name, node id and job id, from Ray's GCS."""
    import json

    code = (
        "import json, ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "from ray._private.state import actors; "
        "print(json.dumps([{'cls': a['ActorClassName'], 'node': a['Address']['NodeID'], 'job': a['JobID']} "
        "for a in actors().values()]))"
    )
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])
