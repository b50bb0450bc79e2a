"""Helpers shared by the tests: real parts started on free ports."""
