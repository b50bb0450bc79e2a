# Over-the-air updates: the trial's check, from the receiver's poll while
# the new version runs in trial (loaded for the trial, dropped with the
# receiver): small, so that the trial boot does not hold otastate.py's code
# (ota.json's writes, the rollback) beside the app the whole time.
import time

from . import unload


def trial(o):
    """From the receiver's poll while a trial runs: confirmed when the
    trial's first reading has left the ring, rolled back when its time is
    up (otastate.py loaded for either)."""
    dev = o.dev
    st = o.st
    if o.first is not None and dev._client is not None and _release_to(dev.ring, o.first):
        from . import otastate

        otastate.done(st)
        otastate = None
        unload("otastate")
        dev.log("ota: confirmed", st.get("v"))
    elif time.ticks_diff(time.ticks_ms(), o.t) > st.get("t", 300) * 1000:
        from . import otastate

        otastate.rewind(st, "not confirmed within %d s" % st.get("t", 300), True, dev)  # resets


def _release_to(ring, seq):
    """The ring holds no record up to ``seq`` any more: the gateway has it
    (receipted), or the broker (PUBACK, receipts off)."""
    segs = ring._segs
    i, off, read = 0, ring._off, ring._read
    while i < len(segs) and read >= segs[i][2]:
        i, off, read = i + 1, 0, 0
    if i >= len(segs):
        return True
    with open(ring._path(segs[i][0]), "rb") as f:
        f.seek(off)
        line = f.readline()
    from .ring import seq_of

    s = seq_of(line, line.find(b" ") + 1)
    return s is not None and s > seq
