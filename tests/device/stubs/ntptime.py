# Stand-in for MicroPython's ntptime: the Unix port's clock is the host's
# (always set), so settime() only records that it was asked, and to which
# server, in _hw_ntp.log in the simulated flash.  ``_hw_ntp_fail`` there
# makes it fail as an unreachable server does (OSError: ETIMEDOUT).
host = "pool.ntp.org"


def settime():
    try:
        open("_hw_ntp_fail").close()
        fail = True
    except OSError:
        fail = False
    with open("_hw_ntp.log", "a") as f:
        f.write(host + (" fail" if fail else " ok") + "\n")
    if fail:
        raise OSError(110)
