"""A copy of the catalog's snapshot off the Ray cluster, so the registrations outlive its head (issue 46 item 5).

The catalog's snapshot lives in Ray's GCS key-value store (``catalog_store.py``), which lives on the head node:
lose the head (without GCS fault tolerance on an external Redis) and every registration is gone with it. With
``serve --catalog-copy LOCATION`` every snapshot written to the GCS is also written to ``LOCATION``: a directory on
storage that survives the head (a persistent or shared disk of the node the controller runs on), or an object-store
prefix (``s3://BUCKET/PREFIX``, beside the adapters: the store the catalog already depends on). A controller that
finds no snapshot in the GCS (a new cluster, after the head was lost) restores the copy, through the same proofs
as any restore: a file that changed meanwhile comes back under its new version or not at all, never the old version
over new bytes. Each service's copy has a name of its own under ``LOCATION`` (``<service>/catalog.v1``), so services
may share one location. A local copy is replaced atomically (written beside, then renamed); an object is replaced
by one PUT.

Why not (only) Ray's GCS fault tolerance: it needs a Redis the operator runs and keeps highly available, and it keeps
the whole cluster's state; the copy needs nothing the deployment does not already have, and survives a new cluster.
"""

from __future__ import annotations

import os
from pathlib import Path

from lora_cache.adapters.objects import StoreUrl, is_store_url
from lora_cache.errors import ConfigError

COPY_NAME = "catalog.v1"
COPY_TIMEOUT_S = 20.0  # each store request of the copy (--store-timeout-s's default)


def check_location(location: str) -> None:
    """A copy's location must name storage the controller reaches: an absolute directory, or a store prefix."""
    if is_store_url(location):
        StoreUrl.parse(location)
    elif not os.path.isabs(location):
        raise ConfigError(f"catalog copy {location!r} is not an absolute directory nor s3://BUCKET/PREFIX: the "
                          "controller may run on another node than this command; give an absolute path on storage "
                          "that outlives the head node, or an object-store prefix")


class CatalogCopy:
    """The catalog snapshot's copy at ``location`` for ``service`` (blocking calls: run them on a thread)."""

    def __init__(self, location: str, service: str) -> None:
        check_location(location)
        self.location = location
        if is_store_url(location):
            url = StoreUrl.parse(location)
            self.bucket, self.key = url.bucket, f"{url.key.rstrip('/')}/{service}/{COPY_NAME}".lstrip("/")
            self.path: Path | None = None
        else:
            self.path = Path(location) / service / COPY_NAME

    def where(self) -> str:
        return str(self.path) if self.path is not None else f"s3://{self.bucket}/{self.key}"

    def get(self) -> bytes | None:
        """The copy's bytes; None if there is none yet."""
        if self.path is not None:
            try:
                return self.path.read_bytes()
            except FileNotFoundError:
                return None
        from lora_cache.adapters.store import call, client
        from lora_cache.errors import AdapterMissingError

        s3 = client(COPY_TIMEOUT_S)
        try:
            return bytes(call(s3, self.bucket, self.key, lambda: s3.get_object(Bucket=self.bucket,
                                                                            Key=self.key)["Body"].read()))
        except AdapterMissingError:
            return None

    def put(self, data: bytes) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_name(f".{COPY_NAME}.{os.getpid()}.part")
            with open(part, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, self.path)  # a reader sees the old copy or the new one, never half of one
            return
        from lora_cache.adapters.store import call, client

        s3 = client(COPY_TIMEOUT_S)
        call(s3, self.bucket, self.key, lambda: s3.put_object(Bucket=self.bucket, Key=self.key, Body=data))
