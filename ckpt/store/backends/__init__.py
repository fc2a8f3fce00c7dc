"""Storage backends: the one interface every byte of the store goes through (base.py), and
its implementations (local.py: a directory; s3.py: an S3 bucket, imported where used since
botocore takes a tenth of a second to import). See "Storage backends" in docs/design.md."""

from ckpt.store.backends.base import (Backend, BlobExists, BlobInfo, BlobNotFound, BlobStream, BlobWriter, LockOwner,
                                      RangeReader)
from ckpt.store.backends.local import LocalBackend

__all__ = ["Backend", "BlobExists", "BlobInfo", "BlobNotFound", "BlobStream", "BlobWriter", "LocalBackend",
           "LockOwner", "RangeReader"]
