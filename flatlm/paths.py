"""One path type for every file flatlm reads or writes: etils `epath.Path` (what orbax and tfds use), so a workdir
is a local folder or a bucket (`gs://bucket/run`) with the same code.

Local paths keep their guarantees: a whole-file write goes to a temporary file in the same folder that is then
renamed over the target, so a reader never sees half a file. On an object store an object only becomes visible
once its upload completed, so a whole-file write is atomic there as it is; an object store has no rename-over,
no append and no file locks: `flatlm.metrics` rewrites metrics.jsonl instead of appending, and `flatlm.locks`
takes no lock there (see its docstring).

gs:// needs gcsfs (through fsspec) unless TensorFlow is installed (epath then uses tf.io.gfile): `path` refuses a
gs:// path without either in one line naming `pip install 'flatlm[gcs]'`, before anything is written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import fsspec
from etils import epath

from flatlm.errors import UserError

CLOUD_SCHEMES = {"gs": ("gcs", "gcs"), "s3": ("s3", "s3"), "az": ("abfs", "az")}  # scheme: (fsspec protocol, extra)
Path = epath.Path  # the type every flatlm function that takes a folder or a file accepts


def scheme(p) -> str | None:
    """The URI scheme of `p` ("gs" for gs://bucket/x), None for a local path."""
    text = os.fspath(p)
    return text.split("://", 1)[0] if "://" in text else None


def is_cloud(p) -> bool:
    """Whether `p` names an object in a bucket (gs://, s3://, az://) rather than a local file."""
    return scheme(p) is not None


def check_backend(p) -> None:
    """UserError (one line) unless the package that reads and writes `p`'s scheme is installed."""
    s = scheme(p)
    if s is None:
        return
    if s not in CLOUD_SCHEMES:
        raise UserError(f"{os.fspath(p)}: flatlm reads and writes local paths and {', '.join(CLOUD_SCHEMES)}:// "
                        f"buckets, not {s}://")
    if importlib.util.find_spec("tensorflow") is not None:  # epath then goes through tf.io.gfile
        return
    protocol, extra = CLOUD_SCHEMES[s]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        raise UserError(f"{os.fspath(p)} is on {s}://, which needs packages that are not installed: "
                        f"pip install 'flatlm[{extra}]'") from None


def path(p, *parts: str) -> epath.Path:
    """`p` (a str, pathlib or epath path; local or gs://) joined with `parts`, as an epath.Path. A cloud path whose
    client is not installed is refused with one line (`check_backend`)."""
    check_backend(p)
    return epath.Path(p, *parts)


def local_path(p) -> epath.Path:
    """A local path made absolute (orbax wants absolute folders); a cloud path as it is."""
    out = path(p)
    return out if is_cloud(out) else epath.Path(os.path.abspath(out))


def write_text(target, text: str, fsync: bool = False) -> None:
    """Write the whole file atomically: a local file via a temporary file renamed over it (`fsync`: flushed to the
    disk first); an object in a bucket in one upload (objects appear whole). No temporary file is left behind."""
    target = path(target)
    if is_cloud(target):
        target.write_text(text)
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_text(target) -> str | None:
    """The file's text, None if it does not exist."""
    target = path(target)
    return target.read_text() if target.exists() else None


def files_under(folder) -> Iterator[epath.Path]:
    """Every file below `folder` (recursively), sorted."""
    folder = path(folder)
    found, top = [], None
    for root, _, names in folder.walk():  # top-down; fsspec names its roots without the gs:// prefix
        top = os.fspath(root) if top is None else top
        rel = os.path.relpath(os.fspath(root), top)
        base = folder if rel == "." else folder / rel
        found.extend(base / n for n in names)
    yield from sorted(found, key=os.fspath)


@contextlib.contextmanager
def local_copy_dir(target) -> Iterator[str]:
    """A local folder to write into, for writers that only write local files (TensorBoard's event files, plots):
    `target` itself when it is local; else a temporary folder whose files are uploaded to `target` on exit."""
    import tempfile  # reason: only cloud targets need a temporary folder

    target = path(target)
    if not is_cloud(target):
        target.mkdir(parents=True, exist_ok=True)
        yield os.fspath(target)
        return
    with tempfile.TemporaryDirectory(prefix="flatlm-upload-") as tmp:
        yield tmp
        upload(tmp, target)


def upload(local_folder: str, target) -> None:
    """Copy every file under the local folder to the same relative path under `target` (overwriting)."""
    target = path(target)
    for root, _, names in os.walk(local_folder):
        rel = os.path.relpath(root, local_folder)
        dest = target if rel == "." else target / rel
        dest.mkdir(parents=True, exist_ok=True)
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                (dest / n).write_bytes(f.read())
