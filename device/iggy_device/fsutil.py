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
    for part in path.split("/"):
        if not part:
            continue
        cur = cur + part if cur in ("", "/") else cur + "/" + part
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
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        _sync(f)
    try:
        os.rename(tmp, path)
    except OSError:
        try:
            os.remove(path)
        except OSError:
            pass
        os.rename(tmp, path)


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


def remove_tree(path):
    """Delete a directory and everything in it (missing: nothing to do)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        p = path + "/" + name
        if not remove(p):
            remove_tree(p)
    try:
        os.rmdir(path)
    except OSError:
        pass


def claim(path, owner, log=None):
    """Make ``path`` (the data directory: ring, seq, command ids, desired
    config) belong to ``owner`` (the device id).  When it holds another
    device's data (the board was re-provisioned under a new id), that data is
    removed: publishing the old board's readings under the new id, or
    continuing its sequence, would be wrong.  Returns True when it removed
    anything.  A directory from before this marker existed is adopted."""
    marker = path + "/owner"
    current = read(marker)
    removed = False
    if current is not None and current.decode() != owner:
        if log is not None:
            log("data: belonged to", repr(current.decode()), "not", repr(owner), "- removed")
        remove_tree(path)
        removed = True
    makedirs(path)
    if removed or current is None:
        write_atomic(marker, owner.encode())
    return removed


def fit(path, want, unit, reserve=65536, log=None):
    """``want`` bytes for the store in directory ``path``, shrunk in whole
    ``unit``s (at least two) to what it holds plus what the flash has free,
    keeping ``reserve`` free for everything else."""
    try:
        st = os.statvfs(path.rpartition("/")[0] or ".")
    except (AttributeError, OSError):
        return want
    room = st[0] * st[4] - reserve  # f_bsize * f_bavail
    try:
        for name in os.listdir(path):
            room += max(0, size(path + "/" + name))
    except OSError:
        pass
    if want <= room:
        return want
    got = max(2 * unit, room // unit * unit)
    if log is not None:
        log("flash: ring_bytes", want, "does not fit, using", got)
    return got
