# Small file helpers shared by the persisted structures (sequence, ring
# buffer, recent command ids, desired config).  Pure: only ``os``.
import os


def exists(path):
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def makedirs(path):
    cur = "/" if path.startswith("/") else ""
    for p in path.split("/"):
        if not p:
            continue
        cur = cur + p if cur in ("", "/") else cur + "/" + p
        if not exists(cur):
            os.mkdir(cur)


def read(path, default=None):
    """Whole file as bytes; falls back to the ``.tmp`` sibling that a
    non-atomic rename (FAT) may have left, then to ``default``."""
    for p in (path, path + ".tmp"):
        try:
            with open(p, "rb") as f:
                return f.read()
        except OSError:
            pass
    return default


def write_atomic(path, data):
    """Write ``data`` so a reader sees the old or the new content, never a
    torn mix.  littlefs and POSIX rename over an existing file atomically;
    FAT refuses, so remove first and rely on ``read`` trying ``.tmp``."""
    t = path + ".tmp"
    with open(t, "wb") as f:
        f.write(data)
        _sync(f)
    try:
        os.rename(t, path)
    except OSError:
        try:
            os.remove(path)
        except OSError:
            pass
        os.rename(t, path)


def remove(path):
    try:
        os.remove(path)
        return True
    except OSError:
        return False


def size(path):
    try:
        return os.stat(path)[6]
    except OSError:
        return -1


def _sync(f):
    # MicroPython flushes to the block device on close(); CPython needs fsync
    # for the same promise.
    f.flush()
    fsync = getattr(os, "fsync", None)
    if fsync is not None:
        fsync(f.fileno())
