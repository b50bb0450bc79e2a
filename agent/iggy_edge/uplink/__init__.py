"""The Iggy boundary.  `protocol` is the interface; `iggy` speaks to a real
server through apache-iggy; `memory` and `file` are implementations we own
for tests, benchmarks and the demo."""
