"""A real S3-compatible server for the tests: moto's server mode, started as its own process on 127.0.0.1
(not an in-process mock), with IAM authentication on, so that wrong credentials are refused as a real store
refuses them. ``S3Server.env`` is what a process needs to reach it (``AWS_ENDPOINT_URL`` and keys), as an
operator sets it; ``pause``/``resume`` (SIGSTOP/SIGCONT) make a stalled server, ``kill`` a dead one.
``S3Server(record=True)`` logs every request the server answers (moto's own recorder, in the server
process): ``requests()`` lists them, ``forget_requests()`` empties the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lora_cache.runtime.ports import free_port
from tests.waiting import wait_for

NO_AUTH_SETUP = 3  # requests moto answers before it enforces IAM: the test user, its policy, its key


class S3Server:
    def __init__(self, auth: bool = True, record: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": str(NO_AUTH_SETUP)} if auth else {})}
        self.log: Path | None = None
        if record:
            fd, name = tempfile.mkstemp(prefix="moto-requests-", suffix=".jsonl")
            os.close(fd)
            self.log = Path(name)
            env.update(MOTO_ENABLE_RECORDING="1", MOTO_RECORDER_FILEPATH=name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-p", str(self.port), "-H", "127.0.0.1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._up, f"moto server on {self.url}", timeout=30)
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "setup",
            "AWS_SECRET_ACCESS_KEY": "setup",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }
        if auth:
            self.env.update(self._user())

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {self.proc.returncode}; is moto[server] installed?")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
            return True
        return False

    def _user(self) -> dict[str, str]:
        iam = self.client("iam")
        iam.create_user(UserName="lora-cache")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="lora-cache", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="lora-cache")["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def client(self, service: str = "s3") -> Any:
        import boto3

        return boto3.session.Session().client(
            service,
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> None:
        """Every file of ``directory`` as ``prefix/<file name>``."""
        s3 = self.client()
        for f in sorted(directory.iterdir()):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())

    def upload_adapters(self, bucket: str, prefix: str, root: Path) -> None:
        """A new ``bucket`` holding every adapter directory under ``root`` as ``prefix/<its name>/``."""
        self.client().create_bucket(Bucket=bucket)
        for d in sorted(root.iterdir()):
            self.upload_dir(bucket, f"{prefix}/{d.name}", d)

    def requests(self) -> list[tuple[str, str]]:
        """(method, path?query) of every request answered since the start or ``forget_requests``."""
        assert self.log is not None, "start the server with record=True"
        rows = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [(r["method"], r["url"].split("://", 1)[-1].partition("/")[2]) for r in rows]

    def forget_requests(self) -> None:
        assert self.log is not None, "start the server with record=True"
        self.log.write_text("")

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.log is not None:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def set_env(monkeypatch: Any, env: dict[str, str]) -> None:
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
