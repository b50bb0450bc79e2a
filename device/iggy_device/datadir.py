# The data directory at boot: whose it is (``claim``) and how large the
# ring may be on this flash (``fit``).  Boot-only: the Device loads this
# module for its constructor and drops it again (``iggy_device.unload``).
# Pure: only ``os``.
import os

from .fsutil import makedirs, read, remove, size, write_atomic


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


def claim(path, dev, log=None):
    """Make ``path`` (the data directory: ring, seq, command ids, desired
    config) belong to ``dev`` (the device id).  When it holds another
    device's data (the board was re-provisioned under a new id), that data is
    removed: publishing the old board's readings under the new id, or
    continuing its sequence, would be wrong.  Returns True when it removed
    anything.  A directory from before this marker existed is adopted."""
    p = path + "/owner"
    cur = read(p)
    found = False
    if cur is not None and cur.decode() != dev:
        if log is not None:
            log("data: belonged to", repr(cur.decode()), "not", repr(dev), "- removed")
        remove_tree(path)
        found = True
    makedirs(path)
    if found or cur is None:
        write_atomic(p, dev.encode())
    return found


def fit(path, want, seg, reserve=65536, log=None):
    """``want`` bytes for the store in directory ``path``, shrunk in whole
    ``seg``s (at least two) to what it holds plus what the flash has free,
    keeping ``reserve`` free for everything else."""
    try:
        st = os.statvfs(path.rpartition("/")[0] or ".")
    except (AttributeError, OSError):
        return want
    n = st[0] * st[4] - reserve  # f_bsize * f_bavail
    try:
        for name in os.listdir(path):
            n += max(0, size(path + "/" + name))
    except OSError:
        pass
    if want <= n:
        return want
    got = max(2 * seg, n // seg * seg)
    if log is not None:
        log("flash: ring_bytes", want, "does not fit, using", got)
    return got
