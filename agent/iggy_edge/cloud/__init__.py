"""The cloud side's part of the return path: provisioning gateways on the
Iggy server with admin credentials (provision.py)."""
