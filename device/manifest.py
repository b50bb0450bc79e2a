# ruff: noqa: F821 - metadata/require/package are provided by the manifest tool
# Manifest for freezing the library into a firmware build or for mip:
#   include("$(PORT_DIR)/boards/manifest.py")
#   include("/path/to/iggy-edge/device/manifest.py")
# Frozen bytecode runs from flash, which saves most of the RAM the library
# would otherwise take on a board without PSRAM.
metadata(description="iggy-edge device library: MQTT telemetry, flash buffer, commands", version="0.1.0")

require("umqtt.simple")
package("iggy_device")
