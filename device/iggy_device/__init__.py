# iggy_device: a small MicroPython library that speaks the iggy-edge MQTT
# conventions.  Import the parts you need (``from iggy_device.node import
# Device``); this file stays empty so that importing one pure module does not
# drag the MQTT client into RAM.
VERSION = "0.1.0"
