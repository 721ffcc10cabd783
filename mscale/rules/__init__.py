"""OPS ARTIFACTS: Prometheus alert and recording rules and the Alertmanager example,
rendered from one parameter file and shipped as package data (`mscale rules export`).

Runs in the CLI only. May import: textfile. Imports no room that runs a process.
"""
