"""A stand-in for Google Cloud Storage in tests: fsspec's in-memory file system registered as the `gcs` protocol,
so `epath.Path("gs://bucket/x")` reads and writes a dict instead of a bucket (what gcsfs would do, minus the
network). Used through the `fake_gcs` fixture of tests/test_cloud_paths.py."""

from __future__ import annotations

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FakeGCS(MemoryFileSystem):
    """MemoryFileSystem answering to gs:// and gcs://, with its own store."""

    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        """`gs://bucket/x` -> `/bucket/x` (the memory file system's key)."""
        path = fsspec.utils.stringify_path(path)
        for prefix in ("gs://", "gcs://"):
            path = path.removeprefix(prefix)
        return super()._strip_protocol(path)


def install() -> None:
    """Register the fake for gs:// (replacing gcsfs if it is installed) and empty it."""
    fsspec.register_implementation("gcs", FakeGCS, clobber=True)
    fsspec.register_implementation("gs", FakeGCS, clobber=True)
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    FakeGCS.clear_instance_cache()


def uninstall() -> None:
    """Forget the fake: gs:// is gcsfs's again (or not installed)."""
    from fsspec.registry import _registry  # reason: fsspec has no public unregister

    for name in ("gcs", "gs"):
        _registry.pop(name, None)
    FakeGCS.store.clear()
