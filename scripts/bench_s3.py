"""Upload and download throughput of the S3 backend next to bare boto3, on the same bytes, against
a SeaweedFS server started here (tests/s3server.py). Usage: python scripts/bench_s3.py [MiB] [runs]

Bare boto3 is measured two ways: one PutObject / GetObject, and its transfer manager
(upload_fileobj / download_fileobj: parallel multipart), the fastest it offers. The ratio is
ckpt's throughput over the faster of the two."""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt.store.backends.s3 import S3Backend  # noqa: E402
from tests.s3server import WeedServer  # noqa: E402


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    data = os.urandom(mib << 20)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-s3-") as workdir:
        server = WeedServer(Path(workdir)).start()
        try:
            os.environ.update(server.environment())
            client = server.client()
            client.create_bucket(Bucket="bench")
            backend = S3Backend("bench", "ckpt")
            results: dict[str, list[float]] = {}

            def record(label, action):
                results.setdefault(label, []).append(timed(action))

            for run in range(runs):
                record("put  boto3 put_object", lambda: client.put_object(Bucket="bench", Key="raw/one", Body=data))
                record("put  boto3 upload_fileobj", lambda: client.upload_fileobj(io.BytesIO(data), "bench", "raw/tm"))
                record("put  ckpt S3Backend.put", lambda: backend.put(f"packs/ab/{run}", data))
                record("get  boto3 get_object",
                       lambda: client.get_object(Bucket="bench", Key="raw/one")["Body"].read())
                record("get  boto3 download_fileobj",
                       lambda: client.download_fileobj("bench", "raw/tm", io.BytesIO()))
                record("get  ckpt S3Backend.get", lambda: backend.get(f"packs/ab/{run}"))
            backend.close()
        finally:
            server.stop()
    speed = {label: (mib / statistics.median(times)) for label, times in results.items()}
    print(f"{mib} MiB, median of {runs} runs, SeaweedFS on 127.0.0.1")
    for label, value in speed.items():
        print(f"  {label:32s} {value:8.1f} MiB/s")
    for kind in ("put", "get"):
        bare = max(value for label, value in speed.items() if label.startswith(kind) and "boto3" in label)
        ours = next(value for label, value in speed.items() if label.startswith(kind) and "ckpt" in label)
        print(f"  {kind}: ckpt / best bare boto3 = {ours / bare:.2f}")


if __name__ == "__main__":
    main()
