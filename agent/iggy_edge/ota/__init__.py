"""Over-the-air updates of the boards' application code (issue 21; docs/ota.md).

The gateway side of /work/ota-protocol.md's contract, kept in docs/ota.md:

- `protocol`: the wire format on ``down/ota`` / ``up/ota`` (replies parsed as untrusted).
- `artifact`: an update's files and the bundle whose sha256 names it.
- `requests`: ``ota.db`` (artifacts, rollouts, updates) and the requests the CLI and the cloud path write.
- `state`: the updater's aiosqlite side of ``ota.db`` and the rollout rule.
- `updater`: the per-board state machine (flow control, resends, bounds).
- `link`: the updater's own MQTT connection (QoS 1 publishes).
- `cloud`: requests and artifacts from the cloud side through Iggy.
- `component`: the runtime component that runs them.
- `build` (CLI only): artifacts from an example or an app directory, compiled with mpy-cross.
"""
