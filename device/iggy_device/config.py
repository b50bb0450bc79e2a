# Device configuration: ``config.json`` (template, safe to commit) overlaid
# by ``config.local.json`` (secrets, git-ignored, written by provisioning or by
# hand).  Validated once at boot into plain attributes; the rest of the
# library never sees the dicts.  The checks and the defaults are in
# configcheck.py, loaded for Config() and dropped again.  Pure: json + fsutil.
import json

from . import fsutil, unload


class ConfigError(ValueError):
    pass


class Config:
    def __init__(self, values):
        # The values stay in one dict, read through __getattr__: copying about
        # 50 keys into the instance's own table needed one more contiguous
        # block at boot (752 bytes on the Unix port), which the heap right
        # after the imports does not always have.  An attribute set later
        # (`cfg.period_ms = p`) is an ordinary one and wins.
        try:
            from .configcheck import merged

            self._v = merged(values)
        finally:
            unload("configcheck")
        self.app = self._v.get("app") or {}

    def __getattr__(self, k):
        if k == "_v":
            raise AttributeError(k)
        try:
            return self._v[k]
        except KeyError:
            raise AttributeError(k) from None


def load(path="config.json", local="config.local.json"):
    values = {}
    for p in (path, local):
        raw = fsutil.read(p)
        if raw is None:
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            raise ConfigError(p + " is not valid JSON") from None
        if not isinstance(doc, dict):
            raise ConfigError(p + " must hold a JSON object")
        values.update(doc)
    if not values:
        raise ConfigError("no " + path + " found")
    return Config(values)
